"""nodetour for Python: gradients from the network straight into GPU memory.

``import nodetour.torch`` registers the ``"nodetour"`` backend of ``torch.distributed``
(``dist.init_process_group("nodetour")``); this package itself imports without torch.

- :class:`Comm` is one rank's communicator (formed by the backend from torch's store; a
  runtime without torch forms it from rank 0's :func:`bind_rendezvous` address).
- :func:`doctor` explains this machine's GPUDirect readiness (``python -m nodetour doctor``).
"""

from ._native import Comm, NodetourError, __version__, bind_rendezvous
from ._native import doctor as _doctor

__all__ = ["Comm", "NodetourError", "bind_rendezvous", "doctor", "__version__"]


def doctor(json: bool = False, live: bool = True) -> "tuple[str, int]":
    """The doctor's report and its exit status (0: every GPU has the direct path, 3: some
    GPU stages, 2: no usable GPU); ``json=True`` gives the JSON document as text."""
    return _doctor(json, live)
