"""Where vLLM's release series differ at our seams: one module per series, chosen once.

Everything else in the plugin is written once against what 0.32 and 0.34 share (the registry
in ``hooks/__init__.py`` lists every target and the series it exists in). What differs lives
in :mod:`.vllm032` and :mod:`.vllm034`, each exporting the same names:

* ``SchedulerConnectorBase``: vLLM's ``AuxOutputSchedulerConnector`` behind one constructor
  ``(kv_cache_manager, kv_connector)`` and one ``_pack_new(block_hashes, num_sent)``; on 0.34
  it also keeps 0.32's prefix-hit semantics (vLLM 0.34 caps hits to blocks its own store
  holds; ours never shortens a KV hit, see ``docs/compatibility.md``).
* ``WORKER_FACTORY_PARAMETERS``: the parameters of MRV2's ``get_aux_output_connector``
  (0.34 builds the worker connector before the KV cache exists and hands its layout to
  ``initialize_output_storage`` later).
* ``prepare_engine_args(engine_args)``: adjusts the engine arguments before vLLM builds its
  configuration (0.34: speculative decoding without lookahead block hashes).
* ``SERIES``: the series the module is for.

The series comes from the installed vLLM (``hooks/versions.vllm_series``); importing this
package on any other vLLM raises :class:`~vllm_artifact.errors.VllmIncompatibleError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_artifact.integration.hooks.versions import vllm_series

if TYPE_CHECKING:  # mypy runs against the CPU build, vLLM 0.32
    from vllm_artifact.integration.seams.vllm032 import (
        SERIES,
        WORKER_FACTORY_PARAMETERS,
        SchedulerConnectorBase,
        prepare_engine_args,
    )
elif vllm_series() == "0.34":
    from vllm_artifact.integration.seams.vllm034 import (
        SERIES,
        WORKER_FACTORY_PARAMETERS,
        SchedulerConnectorBase,
        prepare_engine_args,
    )
else:
    from vllm_artifact.integration.seams.vllm032 import (
        SERIES,
        WORKER_FACTORY_PARAMETERS,
        SchedulerConnectorBase,
        prepare_engine_args,
    )

__all__ = ["SERIES", "WORKER_FACTORY_PARAMETERS", "SchedulerConnectorBase", "prepare_engine_args"]
