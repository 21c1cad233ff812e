"""The profiler's settings (``Settings``: the grid, repeats, passes, the wake-up's windows) and
their checks, without torch: ``qllm-validate`` and ``qllm-profile`` check a configuration with
them before the seconds of importing torch and the minutes of profiling
(``profiler.measure`` runs them)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from profiler.schema import GRID_KEYS, SettingsError, int_list, setting_int

_WARNED: set[str] = set()  # warnings printed once a process

# CPU clocks: wall time, or this process's CPU time (steady on a shared machine; it equals the
# wall time of an uncontended run only with one torch thread).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
WAKE_PROMPT_TOKENS = 64  # the prompt of each window's first iteration, a prefill (_wake_window)
# A decode shape's sequences are prefilled right before its steps (``Profiler.decode``), and
# the steps right after a prefill run slower than a run's steps in a row: in the real runs of
# the curated `make validate` (2026-12-03 22:16; 3 or more steps after an idle gap), a decode
# step of one sequence right after a prefill took 1.02x its prediction over the host-speed
# probe, one after another decode step 0.96x (2-4 sequences: 1.02x and 0.99x; 5-16: 1.02x and
# 1.02x). Paired in one process (80-150 rounds, kv 64), the profile's step after one untimed
# step took 1.04x-1.07x a step of a sequence 4 steps into its decoding (one sequence:
# tiny-qwen2-moe 1.04x, tiny-mixtral 1.05x, tiny-olmoe 1.07x; 4 and 16 of tiny-qwen2-moe
# 1.04x, 1.02x), after 3 untimed 0.98x-1.05x, after 6 0.98x-1.03x (2026-12-04). The default
# of ``Settings.decode_warmup``.
DECODE_WARMUP = 3

# How the engine, and the profile's wake-up windows, wait when there is nothing to run: sleep
# (give the core back to the OS, as serving engines block on their queues; the default) or
# spin (poll the clock on the core). On this project's shared 2-core VM an engine that sleeps
# through its idle gaps ran every light-load iteration slower, not only the first ones after
# a gap: in two paired experiments (tiny-qwen3-moe, 0.3 utilization, 4 replays each, the
# rounds alternately sleeping and spinning, 2026-12-05) the sleeping runs' iterations took
# 1.056x and 1.105x their prediction on average, the spinning runs' 0.995x and 0.982x, with
# 10.3% and 16.2% of iterations over 1.3x against 3.4% and 2.3%: whatever else runs on the
# machine takes a sleeping engine's core and its caches. Spinning is no cure: steps right after
# a 1.26 s spin ran 3% faster than after a sleep or none (medians, tiny-mixtral), and in two
# whole validations with everything spun, the runs' iterations took 0.83-0.99x their
# prediction at every load on four of the five presets (docs/validation-log.md, "Sleeping
# through the idle gaps"). The profile's wake-up windows wait as the engine does
# (``wait_idle``), so what the simulator charges after a gap is what the engine pays after one.
IDLE_WAITS = ("sleep", "spin")


def wait_idle(seconds: float, wait: str) -> None:
    """Let ``seconds`` pass doing nothing, as ``wait`` (IDLE_WAITS) says."""
    if seconds <= 0:
        return
    if wait == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass
class Settings:
    prefill_tokens: list[int]
    decode_batch: list[int]
    decode_kv: list[int]
    expert_tokens: list[int]
    warmup: int = 2
    # untimed steps of a decode shape after its sequences' prefill, before its timed ones
    # (``Profiler.decode``): the steps right after a prefill run slower than a run's steps
    # in a row, and one untimed step does not take all of it out (DECODE_WARMUP)
    decode_warmup: int = DECODE_WARMUP
    repeats: int = 10
    clock: str = "wall"
    routing_prompts: int = 8
    routing_prompt_tokens: int = 64
    seed: int = 0
    wake_idle_ms: tuple[int, ...] = (2, 10, 50, 200, 1000)  # empty: no wake_up op
    wake_repeats: int = 9
    # the prompt of each wake-up window's first iteration, a prefill (``wake_points``)
    wake_prompt_tokens: int = WAKE_PROMPT_TOKENS
    # how each window's gap is waited (IDLE_WAITS): as the engine the profile is for waits
    wake_wait: str = "sleep"
    chunk_kv: tuple[int, ...] = ()  # cached prefixes under each chunk; empty: no attn_chunk
    # batched prefills of about this many tokens (``prefill_batches``); empty: none
    prefill_batch_tokens: tuple[int, ...] = ()
    # also a prefill of two prompts of each prefill_tokens length (2 and more): a batch's first
    # prompt's call (attn_prefill_first) and what a later prompt adds (attn_prefill_next)
    prefill_pairs: bool = True
    passes: int = 1  # sweeps of the grid, each shape's repeats split over them (<= repeats)
    # each pass's shapes in a random order (seeded, another each pass; ``grid_pass``); false:
    # the grid's order, every prefill shape, then every decode shape
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.passes > self.repeats >= 1:  # a pass has a repeat at least
            self.passes = self.repeats

    @classmethod
    def from_config(cls, cfg: Any) -> Settings:
        grid, routing = cfg["grid"], cfg["routing"]
        out = cls(
            **{k: sorted(set(int_list(f"grid.{k}", grid[k]))) for k in GRID_KEYS},
            warmup=setting_int("warmup", cfg["warmup"], 0),
            decode_warmup=setting_int("decode_warmup", cfg.get("decode_warmup", DECODE_WARMUP), 0),
            repeats=setting_int("repeats", cfg["repeats"], 1),
            clock=str(cfg["clock"]),
            routing_prompts=setting_int("routing.prompts", routing["prompts"], 1),
            routing_prompt_tokens=setting_int("routing.prompt_tokens", routing["prompt_tokens"], 1),
            seed=setting_int("seed", cfg["seed"]),
            passes=setting_int("passes", cfg.get("passes", 1), 1),  # 0 is refused, not 1
        )
        out.chunk_kv = tuple(sorted(set(int_list("grid.chunk_kv", grid.get("chunk_kv") or ()))))
        batched = int_list("grid.prefill_batch_tokens", grid.get("prefill_batch_tokens") or ())
        out.prefill_batch_tokens = tuple(sorted(set(batched)))
        # each N runs N // P prompts of the longest prefill P: an N other than P below 2 P
        # runs no batch (P itself is the plain prefill of P), and two Ns of as many prompts
        # run one shape (profile.json records the list as given)
        longest, runs = max(out.prefill_tokens or (1,)), {}
        for n in out.prefill_batch_tokens:
            if n != longest:
                runs.setdefault(n // longest, []).append(n)
        for k, ns in sorted(runs.items()):
            if k < 2 or len(ns) > 1:
                what = ("under 2 prompts: no batch profiled" if k < 2 else
                        f"the same {k} prompts of {longest} tokens: profiled once")  # fmt: skip
                line = (f"warning: grid.prefill_batch_tokens {', '.join(map(str, ns))} with "
                        f"grid.prefill_tokens up to {longest}: {what}")  # fmt: skip
                if line not in _WARNED:  # the check before the run reads them too
                    _WARNED.add(line)
                    print(line, file=sys.stderr)
        pairs = grid.get("prefill_pairs", True)
        if not isinstance(pairs, bool):
            raise SettingsError(f"grid.prefill_pairs={pairs}: must be true or false")
        out.prefill_pairs = pairs
        shuffle = cfg.get("shuffle", True)
        if not isinstance(shuffle, bool):
            raise SettingsError(f"shuffle={shuffle}: must be true or false")
        out.shuffle = shuffle
        wake = cfg.get("wake", {})
        if wake is None:  # as idle_ms: [] (it measured the default five idle times)
            out.wake_idle_ms = ()
        else:
            out.wake_idle_ms = tuple(sorted(set(int_list("wake.idle_ms", wake["idle_ms"]))))
            out.wake_repeats = setting_int("wake.repeats", wake["repeats"], 1)
            out.wake_prompt_tokens = setting_int(
                "wake.prompt_tokens", wake.get("prompt_tokens", WAKE_PROMPT_TOKENS), 1
            )
            out.wake_wait = str(wake.get("wait") or "sleep")
        out.validate()
        return out

    def validate(self) -> None:
        for key in GRID_KEYS:
            values = getattr(self, key)
            if not values or min(values) < 1:
                raise SettingsError(f"grid.{key} must be a non-empty list of integers >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise SettingsError("repeats must be >= 1 and warmup >= 0")
        if self.decode_warmup < 0:
            raise SettingsError(f"decode_warmup={self.decode_warmup}: must be >= 0")
        if self.passes < 1:
            raise SettingsError(f"passes={self.passes}: must be >= 1")
        self.passes = min(self.passes, self.repeats)  # a pass has a repeat at least
        if self.clock not in CLOCKS:
            raise SettingsError(f"clock={self.clock}: expected one of {', '.join(CLOCKS)}")
        if self.routing_prompts < 1 or self.routing_prompt_tokens < 1:
            raise SettingsError("routing.prompts and routing.prompt_tokens must be >= 1")
        if self.chunk_kv and min(self.chunk_kv) < 1:
            raise SettingsError("grid.chunk_kv must be integers >= 1 (or empty)")
        if self.prefill_batch_tokens and min(self.prefill_batch_tokens) < 1:
            raise SettingsError("grid.prefill_batch_tokens must be integers >= 1 (or empty)")
        if self.wake_idle_ms and (min(self.wake_idle_ms) < 1 or self.wake_repeats < 1):
            raise SettingsError("wake.idle_ms must be integers >= 1 and wake.repeats >= 1")
        if self.wake_prompt_tokens < 1:
            raise SettingsError(f"wake.prompt_tokens={self.wake_prompt_tokens}: must be >= 1")
        if self.wake_wait not in IDLE_WAITS:
            raise SettingsError(f"wake.wait={self.wake_wait}: expected one of "
                                f"{', '.join(IDLE_WAITS)}")  # fmt: skip

    def pass_repeats(self, k: int) -> int:
        """The repeats of pass k (0-based): ``repeats`` split as evenly as ``passes`` allow."""
        return self.repeats // self.passes + (k < self.repeats % self.passes)

    def pass_prefill_repeats(self, k: int) -> int:
        """The repeats of pass k of a jittered prefill shape (``Profiler.prefill``): whole
        pairs, one prompt length shorter and one longer in each (so that no pass times one
        side alone, read at that pass's host speed), ``repeats`` rounded up to pairs and the
        pairs split as evenly as ``passes`` allow (a pass may have none)."""
        if self.repeats < 2:
            return self.pass_repeats(k)
        pairs = -(-self.repeats // 2)
        return 2 * (pairs // self.passes + (k < pairs % self.passes))

    def pass_wake_repeats(self, k: int) -> int:
        """The wake-up's repeats in pass k (``Profiler.grid_pass``): ``wake_repeats`` spread
        as evenly as ``passes`` allow (9 over 12: passes 1-3, 5-7 and 9-11), so that they
        sample the machine's whole stretch, as the shapes do."""
        return (k + 1) * self.wake_repeats // self.passes - k * self.wake_repeats // self.passes

    @property
    def num_iterations(self) -> int:
        """Iteration shapes profiled (the progress bar's length)."""
        decode = len(self.decode_batch) * len(self.decode_kv)
        prefill = len(self.prefill_tokens) * (1 + len(self.chunk_kv)) + len(self.prefill_batches)
        return prefill + len(self.prefill_pairs_tokens) + len(self.prompt_counts) + decode

    @property
    def prefill_pairs_tokens(self) -> list[int]:
        """The prompt lengths profiled in pairs (``prefill_pairs``): those of 2 tokens or more
        (two 1-token prompts run as a decode step)."""
        return [n for n in self.prefill_tokens if n >= 2] if self.prefill_pairs else []

    @property
    def prefill_batches(self) -> list[int]:
        """The batched prefills' prompt counts: N // P prompts of P = max(prefill_tokens) for
        each N of ``prefill_batch_tokens``, those of 2 prompts or more (one prompt of up to P
        tokens is a plain prefill)."""
        longest = max(self.prefill_tokens)
        return sorted({k for n in self.prefill_batch_tokens if (k := n // longest) >= 2})

    @property
    def prompt_counts(self) -> list[int]:
        """The batched prefills' prompt counts k also profiled at the grid's longest prompt's
        tokens P, in k prompts of P // k (those of 2 tokens or more; k = 2 where the pairs
        have it already): beside one prompt of P, they measure what k prompts add to a
        prefill's once-per-iteration stages (``sim.latency.PromptCurve``), which the batched
        prefills of P tokens a prompt cannot tell from their many more tokens."""
        longest = max(self.prefill_tokens)
        pairs = set(self.prefill_pairs_tokens)
        return [k for k in self.prefill_batches
                if longest // k >= 2 and not (k == 2 and longest // 2 in pairs)]  # fmt: skip
