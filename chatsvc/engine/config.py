"""Engine configuration: one frozen dataclass, validated, readable from CHATSVC_* variables.

``EngineConfig`` is what an operator sets (flat, one variable per field); the
parts of the engine take their own views of it, built here and nowhere else:
``EngineConfig.scheduler`` is the scheduler's ``SchedulerConfig``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

# kernels.linear.WEIGHT_DTYPES, named here too so settings are checked without torch
# (tests/engine/test_model_linear.py holds them equal).
WEIGHT_DTYPES = ("auto", "bf16", "int8", "fp32")
# kernels.kv_layout.KV_DTYPES, likewise (tests/engine/test_engine_config.py).
KV_DTYPES = ("auto", "bf16", "int8")

ENV_PREFIX = "CHATSVC_"
# The default pool: as many blocks as this many bytes hold in bf16, in every float dtype,
# so a CPU without native bf16 (fp32, twice the bytes a block) caches as many sessions;
# with int8 KV, as many as these bytes hold in int8 (the point of int8: ~1.9x the sessions
# in the same memory).
DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_KV_DISK_PRELOAD_BYTES = 512 << 20


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and the starvation bound of the waiting queue."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_wait_steps: int = 64  # a sequence waiting longer than this goes first
    max_wait_s: float = 10.0  # ... or longer than this
    max_defer_steps: int = 4  # steps a request may wait for another's prefill of its prefix
    # How long sequences whose disk loads landed wait for the loads still in flight
    # before they compute, when nothing else runs (Scheduler._gathers_loads); 0: never.
    max_load_gather_s: float = 0.1
    # Split each step's token budget between the tenants with work in it (fairness.py);
    # False: the first tenant in line may fill the step.
    tenant_step_share: bool = True

    def validate(self) -> SchedulerConfig:
        """Raise ValueError on the first bad value; returns self."""
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_wait_steps < 1 or self.max_wait_s <= 0:
            raise ValueError("max_wait_steps and max_wait_s must be positive")
        if self.max_defer_steps < 0:
            raise ValueError("max_defer_steps must be >= 0")
        if self.max_load_gather_s < 0:
            raise ValueError("max_load_gather_s must be >= 0")
        return self


SPECULATIVE_MODES = ("off", "ngram", "suffix")


@dataclass(frozen=True)
class EngineConfig:
    """What to serve and how much memory and batch room to give it.

    KV pool size: ``num_gpu_blocks`` when set, else ``kv_cache_bytes`` divided by the
    bytes of one block (all layers, K and V, in ``kv_dtype``); ``kv_cache_bytes`` None: the
    blocks ``DEFAULT_KV_CACHE_BYTES`` holds in bf16, whatever the float dtype, or in int8
    with int8 KV. ``kv_dtype``: "auto" (the model's dtype), "bf16" (an fp32 model's K/V
    rounded to bf16: half the bytes a step reads, twice the blocks) or "int8" (rows with a
    scale per token and KV head, ``kernels.kv_layout``); a cache narrower than the model
    is read by every backend, Triton through its invariant kernel only.
    ``num_host_blocks`` sizes the host tier that evicted prefix blocks move to
    (``host_blocks_for``). ``max_model_len``
    caps the context (default: the model's own limit). ``debug_checks`` runs the cache's integrity
    checker after every mutation (slow; for tests). ``data_dir``: where the converted default
    model and the compiled kernels are cached (the service's data directory; None:
    ``~/.cache/chatsvc``). The batch fields are the scheduler's (``scheduler``).

    Disk tier (``chatsvc.engine.kv_disk``): block files under ``kv_disk_dir`` (None: no
    disk tier; the service sets ``$CHATSVC_DATA_DIR/kv``), at most ``kv_disk_bytes``
    (None: the smaller of 8 GiB and a tenth of the free space, re-checked; 0: off).
    ``kv_disk_write`` is "through" (store each block once it is computed) or "back"
    (only when the memory tiers drop it, and at shutdown).
    """

    model: str = "smollm2"
    dtype: str | None = None  # "bf16" | "fp16" | "fp32"; None: bf16 where native, else fp32
    # What an fp32 model stores its matrices in (kernels.linear.WEIGHT_DTYPES): "auto" =
    # bf16 where that loses nothing (a bf16 checkpoint), "bf16", "int8", "fp32".
    weight_dtype: str = "auto"
    # A token's values (K, V, logits) independent of what else its step computes, so the
    # answer is the same whatever the cache held and whatever was batched beside it
    # (kernels/invariance.py); False: the fastest kernels for each step's shape.
    invariant: bool = True
    # What the KV cache stores (KV_DTYPES): "auto" = the model's dtype, "bf16", "int8".
    kv_dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # None: on CUDA, a host tier as large as the device pool (pinned memory);
    # on CPU none, since "host" would be the same RAM: raise kv_cache_bytes instead.
    num_host_blocks: int | None = None
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_model_len: int | None = None
    max_wait_steps: int = SchedulerConfig.max_wait_steps
    # 0: never wait for another request's prefill of a prefix
    max_defer_steps: int = SchedulerConfig.max_defer_steps
    tenant_step_share: bool = SchedulerConfig.tenant_step_share
    max_load_gather_s: float = SchedulerConfig.max_load_gather_s
    debug_checks: bool = False
    seed: int = 0  # random-weights models only
    num_threads: int | None = None  # torch intra-op threads; None: the usable CPUs, governed
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = None
    kv_disk_write: str = "through"
    kv_disk_fsync: bool = False  # fsync each block file (a checksum catches torn ones anyway)
    kv_disk_queue_blocks: int = 64  # block writes in flight; more are dropped, never waited for
    kv_disk_retry_s: int = 10  # writes pause this long after a write error
    kv_disk_load_threads: int = 2  # threads reading blocks back (one of them also writes)
    # After a restart, at most this many bytes of the most recently used sessions' block
    # files are read into memory while the engine is idle (kv_disk/preload.py); 0: none.
    kv_disk_preload_bytes: int = DEFAULT_KV_DISK_PRELOAD_BYTES
    # Other fingerprints' directories under kv_disk_dir (another model, dtype, layout or
    # build of the kernels) unused this long are removed at start (kv_disk/directory.py).
    kv_disk_keep_other_days: float = 7.0
    # Speculative decoding without a draft model (speculation.py): "ngram" proposes from
    # the request's own tokens, "suffix" also from its tenant's earlier outputs, "off".
    speculative: str = "off"
    speculative_max_k: int = 4  # proposals verified per step at most (adaptive below it)
    # Seconds the warm-up before serving may take (engine/warmup.py); 0: none.
    warm_up_s: float = 30.0
    # Seconds the engine may hold requests without progress before it is stopped as
    # dead (watchdog.py: the stacks go to the log, the service exits); 0: not watched.
    watchdog_timeout_s: float = 300.0
    data_dir: str | None = None

    @property
    def scheduler(self) -> SchedulerConfig:
        """The scheduler's limits, out of this config's batch fields."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_wait_steps=self.max_wait_steps,
            max_defer_steps=self.max_defer_steps,
            tenant_step_share=self.tenant_step_share,
            max_load_gather_s=self.max_load_gather_s,
        )

    def validate(self) -> EngineConfig:
        """Raise ValueError on the first bad value; returns self."""
        if not self.model:
            raise ValueError("model must name a model spec")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        self.scheduler.validate()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_disk_bytes is not None and self.kv_disk_bytes < 0:
            raise ValueError(f"kv_disk_bytes must be >= 0 (0 = off), got {self.kv_disk_bytes}")
        if self.kv_disk_write not in ("through", "back"):
            raise ValueError(
                f"kv_disk_write must be 'through' or 'back', got {self.kv_disk_write!r}"
            )
        if self.kv_disk_queue_blocks < 1 or self.kv_disk_retry_s < 0:
            raise ValueError("kv_disk_queue_blocks must be >= 1 and kv_disk_retry_s >= 0")
        if self.kv_disk_preload_bytes < 0:
            raise ValueError(
                f"kv_disk_preload_bytes must be >= 0 (0 = none), got {self.kv_disk_preload_bytes}"
            )
        if not self.kv_disk_keep_other_days >= 0:
            raise ValueError(
                f"kv_disk_keep_other_days must be >= 0, got {self.kv_disk_keep_other_days}"
            )
        if self.kv_disk_load_threads < 1:
            raise ValueError(f"kv_disk_load_threads must be >= 1, got {self.kv_disk_load_threads}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}"
            )
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}"
            )
        if not 1 <= self.speculative_max_k <= 16:
            raise ValueError(f"speculative_max_k must be 1..16, got {self.speculative_max_k}")
        if not 0 <= self.warm_up_s <= 3600:
            raise ValueError(f"warm_up_s must be 0..3600 seconds, got {self.warm_up_s}")
        if not self.watchdog_timeout_s >= 0:
            raise ValueError(
                f"watchdog_timeout_s must be >= 0 (0 = off), got {self.watchdog_timeout_s}"
            )
        return self

    def num_blocks_for(self, block_bytes: int, default_block_bytes: int) -> int:
        """Device blocks of the KV pool, given one block's size in bytes in the pool's
        dtype and in the default's unit (bf16 for float KV, int8 for int8 KV)."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        if self.kv_cache_bytes is None:
            return max(1, DEFAULT_KV_CACHE_BYTES // default_block_bytes)
        num_blocks = self.kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={self.kv_cache_bytes} holds no block of {block_bytes} bytes"
            )
        return num_blocks

    def host_blocks_for(self, num_gpu_blocks: int) -> int:
        """Blocks of the host tier that evicted prefix blocks move to (0 = none)."""
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return num_gpu_blocks if self.device.startswith("cuda") else 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> EngineConfig:
        """Read ``CHATSVC_<FIELD>`` (e.g. CHATSVC_NUM_GPU_BLOCKS); unset fields keep defaults.

        Raises ValueError naming the variable on a value that does not parse.
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            raw = env.get(name)
            if raw is None or not raw.strip():
                continue
            values[f.name] = _parse(name, raw.strip(), cls.__dataclass_fields__[f.name].type)
        values.update(overrides)
        return cls(**values).validate()


def _parse(name: str, raw: str, annotation: str) -> object:
    try:
        if annotation.startswith("bool"):
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if annotation.startswith("int"):
            return int(raw)
        if annotation.startswith("float"):
            value = float(raw)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(raw)
            return value
        return raw
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {annotation.split(' ')[0]}") from None
