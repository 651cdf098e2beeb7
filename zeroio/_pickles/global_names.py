"""A pickled global's name as Python 3 spells it, for the restricted unpickler and the hash walk alike (a leaf:
:mod:`.hash_work` sits below :mod:`.allowed` in the import order)."""

from __future__ import annotations

import _compat_pickle

__all__ = ["python2_name"]


def python2_name(module: str, name: str) -> tuple[str, str]:
    """``module.name`` as Python 3 spells it: what ``pickle.Unpickler.find_class`` does for protocol < 3 pickles.

    torch.save writes protocol 2, where Python's pickler spells builtins by their Python 2 names: a ``set`` in a
    checkpoint (DeepSpeed <= 0.18's ``sparse_tensor_module_names``) is ``__builtin__.set``. Overriding
    ``find_class`` skips that mapping, so the restricted unpickler applies it before the allowlist is asked,
    and the hash walk (:mod:`.hash_work`) names the globals it sees the same way.
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name
