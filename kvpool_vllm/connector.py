"""`MemdConnector`: memd as a KV store vLLM loads through its connector API, by one flag.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MemdConnector",
        "kv_connector_module_path": "kvpool_vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"memd_address": "unix:/run/memd/memd.sock"}}'

vLLM builds one per role: in its engine-core process the scheduler side
(`SchedulerSide`: lookups and one memd Step per engine step), in each worker
process the worker side (`WorkerSide`: checked loads and checksummed saves,
whole blocks copied between vLLM's KV cache and memd's pool). Each attaches
to memd on its own, under the engine's namespace (`kvpool_vllm.namespace`),
and its attachment is its lease: a vLLM process killed leaves memd nothing
to clean up by hand. This module is the only one that imports vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from kvpool_vllm.memd_link import AttachSpec, MemdLink
from kvpool_vllm.namespace import namespace
from kvpool_vllm.scheduler_side import SchedulerSide
from kvpool_vllm.settings import Settings, SettingsError
from kvpool_vllm.step_plan import StepPlan
from kvpool_vllm.worker_side import WorkerReport, WorkerSide

if TYPE_CHECKING:
    import torch


@dataclass
class MemdStepMetadata(KVConnectorMetadata):
    """Scheduler side -> worker side, each engine step: the pages to check and load, and to save into."""

    plan: StepPlan


@dataclass
class MemdWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker side -> scheduler side, each engine step: saved pages' checksums, loads that failed."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MemdWorkerMetadata)
        return MemdWorkerMetadata(self.report.merge(other.report))


class MemdConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = Settings.parse(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            raise SettingsError('kvpool connector: set "kv_load_failure_policy": "recompute" in '
                                "--kv-transfer-config: a page that fails its check is recomputed, never an error")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise SettingsError("kvpool connector: one worker per engine only for now (tensor and pipeline "
                                "parallel size 1)")
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise SettingsError("kvpool connector: speculative decoding is not supported yet (a block holding "
                                "draft tokens vLLM later rejects must never be saved)")
        model, bytes_per_token = namespace(vllm_config, kv_cache_config)
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.num_blocks = kv_cache_config.num_blocks
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        link = MemdLink(AttachSpec(settings.memd_address, model, self.block_size, bytes_per_token,
                                   f"vllm-{side}:{os.getpid()}", map_memory=side == "worker"),
                        timeout_s=settings.timeout_s)
        link.wait_up(settings.timeout_s)            # serve at once with memd if it is there; without it if not
        self._scheduler = SchedulerSide(link, self.block_size, settings) if side == "scheduler" else None
        self._medium = "GPU" if vllm_config.device_config.device_type == "cuda" else "CPU"      # memd's pool's
        self._worker = WorkerSide(link) if side == "worker" else None

    # ---- scheduler side ----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return MemdStepMetadata(self._scheduler.build(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._scheduler.reported(meta.report if isinstance(meta, MemdWorkerMetadata) else None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request.request_id)
        return False, None            # saves are copied within their engine step: vLLM may free the blocks now

    def take_events(self) -> Iterable[BlockStored]:
        """The blocks memd now holds for this engine, announced as vLLM announces its own (its block hashes, its
        extra keys) with memd's tier as their medium, so a router that recomputes vLLM's hashes finds them."""
        assert self._scheduler is not None
        bs = self.block_size
        for request, start, end in self._scheduler.take_stored():
            hashes = request.block_hashes
            for i in range(start, min(end, len(hashes))):
                extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
                yield BlockStored(block_hashes=[maybe_convert_block_hash(hashes[i])],
                                  parent_block_hash=maybe_convert_block_hash(hashes[i - 1]) if i else None,
                                  token_ids=list(request.all_token_ids[i * bs:(i + 1) * bs]), block_size=bs,
                                  lora_id=None, medium=self._medium, lora_name=None,
                                  extra_keys=to_event_extra_keys([extra]), group_idx=0, ownership="kvpool-memd")

    # ---- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self.num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, MemdStepMetadata):
            self._worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                          # loads are done before the forward pass starts

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return                          # saved whole blocks of every layer at once, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, MemdStepMetadata):
            self._worker.save(meta.plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        report = self._worker.take_report()
        return MemdWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.link.close()
