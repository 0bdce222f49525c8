"""Real training data: a token directory (`tokens`), its samples in a
seeded, O(1)-memory order (`sampler`), the tokenizers that make it
(`tokenizer`) and the preparation of a directory from text (`prepare`).

Invariant: this layer imports only `meshplan.errors` from meshplan (plus
numpy, torch and the optional `tokenizers`, `transformers`, `datasets`).
"""

from meshplan.data.prepare import expand_inputs, prepare_data
from meshplan.data.sampler import SampleReader, num_samples, sample_ids
from meshplan.data.tokenizer import Tokenizer, load_tokenizer, parse_tokenizer_arg
from meshplan.data.tokens import TokenData, is_token_dir

__all__ = ["SampleReader", "TokenData", "Tokenizer", "expand_inputs", "is_token_dir",
           "load_tokenizer", "num_samples", "parse_tokenizer_arg", "prepare_data",
           "sample_ids"]
