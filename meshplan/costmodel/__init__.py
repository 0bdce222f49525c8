"""Device models as data: what a device computes and moves per second
(`device.py`), and the named models, built in or measured here (`load.py`).

Below the simulator (`lowering/action_times.py`), which costs every action
with one of these; imports only `errors` and torch.
"""

from meshplan.costmodel.device import CPU_DEFAULT, DeviceModel
from meshplan.costmodel.load import known_device_models, load_device_model

__all__ = ["CPU_DEFAULT", "DeviceModel", "known_device_models", "load_device_model"]
