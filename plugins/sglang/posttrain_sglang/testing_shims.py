"""TEST SUPPORT ONLY: import shims that let SGLang 0.5.23 run on a CPU-only machine.

SGLang's wheel requires ``sglang-kernel`` (CUDA-only wheels) and ``torchvision`` (whose PyPI
builds are CUDA builds that break on CPU-only machines). Plain decoding on CPU uses neither, but
SGLang imports both at module level: ``torchvision`` for ``InterpolationMode`` in multimodal
configs, ``sgl_kernel`` for names in CPU kv-cache / speculative modules that plain decoding never
calls. This module provides stand-ins for those imports and nothing else:

* the names listed in ``PLACEHOLDERS`` are placeholder classes that raise when instantiated or
  called, ``torchvision.transforms.InterpolationMode`` is a plain enum of strings, and any other
  name is missing (so SGLang's optional imports take their own fallbacks): no computation is
  faked;
* nothing is registered under ``torch.ops.sgl_kernel``, so SGLang's own check
  (``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``) keeps its AMX kernels off;
* the finder sits at the end of ``sys.meta_path``: where the real package is installed it wins,
  and the shims are never used (the GPU machine, a full SGLang install);
* only imports made by SGLang's own modules get a shim: anyone else asking (transformers'
  ``is_torchvision_available`` probes with ``importlib.util.find_spec``) still finds the packages
  missing, and no distribution metadata is created.

SGLang starts its scheduler in spawned subprocesses, which import SGLang afresh: the shims must be
installed in every interpreter of the environment. ``.ci/sglang_env.sh`` does so with a ``.pth``
file (``posttrain_sglang_testing_shims.pth``) in the test virtual environment only; nothing
installs it elsewhere. This module imports only the standard library (it runs at every start).
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import NoReturn

SHIMMED = ("torchvision", "sgl_kernel")
# The submodules SGLang 0.5.23 imports at module level, without a fallback, on the CPU path.
MODULES: tuple[str, ...] = (
    "torchvision.transforms",
    "torchvision.transforms.functional",
)
# The names SGLang 0.5.23 imports at module level, without a fallback, on the CPU decoding path.
PLACEHOLDERS: frozenset[str] = frozenset(
    {
        "sgl_kernel.assign_draft_cache_locs_contiguous_cpu",
        "sgl_kernel.assign_extend_cache_locs_cpu",
        "sgl_kernel.assign_req_to_token_pool_cpu",
        "sgl_kernel.build_tree_kernel_efficient_cpu",
        "sgl_kernel.copy_all_layer_kv_cache_cpu",
        "sgl_kernel.fill_accept_out_cache_loc_cpu",
        "sgl_kernel.fill_bonus_tokens_cpu",
        "sgl_kernel.verify_tree_greedy_cpu",
    }
)


class InterpolationMode(enum.Enum):
    """A copy of ``torchvision.transforms.InterpolationMode``: data, not computation."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualname: str) -> type:
    """A placeholder for ``qualname``: usable as a name, base class or isinstance target at
    import time; raises as soon as anything tries to use it."""

    def refuse(*_args: object, **_kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"{qualname} is not installed: posttrain_sglang.testing_shims only stands in for "
            "imports that SGLang's CPU decoding never calls"
        )

    return type(qualname.rpartition(".")[2], (), {"__new__": refuse, "__module__": qualname})


class _ShimModule(types.ModuleType):
    __posttrain_shim__ = True  # what is_shim looks for

    def __getattr__(self, name: str) -> type:
        qualname = f"{self.__name__}.{name}"
        if qualname not in PLACEHOLDERS:
            # ``from sgl_kernel.x import y`` then raises ImportError, which SGLang's optional
            # imports already handle (e.g. its own fallback for ``scalar_types``).
            raise AttributeError(f"{qualname} (not provided by posttrain_sglang.testing_shims)")
        value = _unavailable(qualname)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _ShimModule(spec.name)
        module.__path__ = []  # a package: any submodule import goes through the finder again
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ in ("torchvision.transforms", "torchvision.transforms.functional"):
            vars(module)["InterpolationMode"] = InterpolationMode


def _importer_is_sglang() -> bool:
    """Whether the innermost frame outside the import machinery belongs to SGLang (or to a
    shim module importing its own submodules)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("importlib", "_frozen_importlib")) or name == __name__):
            top = name.partition(".")[0]
            return top == "sglang" or top in SHIMMED
        frame = frame.f_back
    return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in SHIMMED + MODULES or not _importer_is_sglang():
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> None:
    """Append the finder to ``sys.meta_path`` (idempotent)."""
    if not installed():
        sys.meta_path.append(_Finder())


def is_shim(module: object) -> bool:
    return bool(getattr(module, "__posttrain_shim__", False))
