"""What a checkpoint says of the model it holds (`model.json`, copied into
every checkpoint beside the resolved `config.toml`): enough to export the
weights for transformers or torch without the run's flags or its code.

Invariants:
- `model` names what was trained: a zoo model (`gpt`), a transformers type
  (`hf:gpt2`), or a user's module (`module:PKG.MOD:FACTORY`, or `module`
  from the API).
- `hf_config` is the transformers config (`to_dict()`) a transformers model
  was trained with, or None; `architecture` the class trained (its config
  may be a sub-config no Auto class maps, as `MllamaForCausalLM`'s text
  config); `prefix` is the state names' prefix before transformers' own
  names (`model.`: the `HFLoss` wrapper).
- `aliases` maps a tied tensor's saved name (the graph input's) to all its
  names, so an export can write it once under the name its format expects.
- `data` is the token directory the run read (its tokenizer travels with an
  export), or "".
"""

from __future__ import annotations

import json
from pathlib import Path

from meshplan.errors import RuntimeFault
from meshplan.models.hf import HFLoss

MODEL_FILE = "model.json"


def model_record(job, module, model: str, data_dir: str = "",
                 hf_config: dict | None = None) -> dict:
    """The record of `module` trained by `job` (`hf_config`: the config to
    export, when not the module's own, e.g. the one an `--init-from`
    directory holds)."""
    g = job.graph
    prefix, architecture = "", ""
    if isinstance(module, HFLoss):
        prefix, architecture = "model.", type(module.model).__name__
        if hf_config is None:
            hf_config = json.loads(module.model.config.to_json_string(use_diff=False))
    aliases = {}
    for i in g.inputs:
        names = g.names_of(g.values[i].name)
        if len(names) > 1:
            aliases[g.values[i].name] = list(names)
    return {"model": model, "hf_config": hf_config, "architecture": architecture,
            "prefix": prefix, "aliases": aliases,
            "data": str(Path(data_dir).resolve()) if data_dir else ""}


def read_model_record(checkpoint: str | Path) -> dict:
    """The record a checkpoint holds; one line if it has none."""
    path = Path(checkpoint) / MODEL_FILE
    if not path.is_file():
        raise RuntimeFault(f"checkpoint {checkpoint} has no {MODEL_FILE} (it was saved by an "
                           "older meshplan, or not by `meshplan train`); save it again")
    return json.loads(path.read_text())
