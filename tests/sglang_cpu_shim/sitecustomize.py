"""TEST-ONLY torch-level shim for SGLang 0.5.23's --enable-return-routed-experts on a CPU.

SGLang allocates its routed-experts host buffer with pin_memory=True and registers it with
`torch.cuda.cudart().cudaHostRegister` (srt/state_capturer/base.py -> mem_cache/pool_host/common.py
_cuda_host_register), which on a CUDA build of torch without a GPU raises "Found no NVIDIA driver"
and the engine does not start. Here `torch.cuda.cudart()` registers nothing and reports success:
the buffer stays ordinary (pageable) CPU memory, which is all a CPU engine reads it as. No SGLang
code is changed. tests/test_sglang_runtime.py puts this folder first on PYTHONPATH of that one
engine only (Python imports `sitecustomize` at start-up)."""
import torch


class _NoHostRegistration:
    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - cudart's names
        return 0  # cudaSuccess

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0


torch.cuda.cudart = lambda: _NoHostRegistration()
