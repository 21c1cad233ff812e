"""The KV memory models' arithmetic at its edges, worked out by hand from their documented rules
(policies/memory.py): whole blocks, the watermark held back at admission only, the peak, what
freeing returns, and the settings each model refuses. Written to kill mutants that the broader
tests let survive (README, "Mutation testing")."""

from __future__ import annotations

import pytest

from policies import Request, Sequence
from policies.memory import Memory, PagedMemory, ReserveMemory, build_memory


def seq(i: int, prompt: int, out: int) -> Sequence:
    return Sequence(Request(i, "BE", 0.0, prompt, out))


def test_paged_capacity_is_whole_blocks_and_the_watermark_rounds_up_to_a_block():
    mem = PagedMemory(100, block_size_tokens=16, watermark=0.01)  # 6 blocks, 4 tokens unusable
    assert (mem.num_blocks, mem.capacity_tokens) == (6, 96)
    assert mem.watermark_blocks == 1  # ceil(0.06)
    assert mem.admission_limit_tokens == 80
    no_watermark = PagedMemory(100, block_size_tokens=10, watermark=0.0)
    assert no_watermark.admission_limit_tokens == no_watermark.capacity_tokens == 100
    # a request alone must be admissible and grow to its end: its blocks plus the watermark,
    # its KV at most prompt + output - 1 tokens (the last token's is never written)
    assert mem.max_tokens(seq(0, 20, 13)) == 32 + 16
    assert mem.max_tokens(seq(0, 20, 14)) == 48 + 16
    assert no_watermark.max_tokens(seq(0, 20, 13)) == 40


def test_paged_admission_stops_at_the_watermark_but_growth_may_use_it():
    mem = PagedMemory(40, block_size_tokens=10, watermark=0.25)  # 4 blocks, 1 held back
    assert mem.fits(30) and not mem.fits(31)  # admission: up to 3 blocks
    a = seq(0, 25, 10)
    assert mem.admit_tokens(a) == 30
    mem.admit(a)
    assert mem.used_tokens == 30 and mem.held_tokens(a) == 30 and mem.blocks == {0: 3}
    assert not mem.fits(1)
    a.generated = 6  # the KV is prompt + 5 = 30 tokens long; the next decode writes token 31
    assert mem.can_grow(a)  # the fourth block: the watermark's, allowed to growth
    mem.grow(a)
    assert mem.used_tokens == 40 and mem.blocks == {0: 4}
    a.generated = 16  # KV 40 long: a fifth block would pass the capacity
    assert not mem.can_grow(a)
    assert mem.free(a) == 40 and mem.used_tokens == 0 and mem.blocks == {}
    assert mem.free(a) == 0 and mem.held_tokens(a) == 0  # nothing left to free


def test_paged_growth_within_a_block_charges_nothing():
    mem = PagedMemory(64, block_size_tokens=16, watermark=0.0)
    a = seq(0, 10, 20)
    mem.admit(a)  # 10 tokens: one block
    a.generated = 3  # KV 12 long, the decode writes the 13th: still the first block
    assert mem.can_grow(a)
    mem.grow(a)
    assert mem.used_tokens == 16 and mem.blocks == {0: 1}
    a.generated = 7  # the decode writes the 17th: a second block
    mem.grow(a)
    assert mem.used_tokens == 32 and mem.blocks == {0: 2}


def test_reserve_charges_prompt_plus_output_and_frees_it():
    mem = ReserveMemory(100)
    a = seq(0, 30, 20)
    assert mem.max_tokens(a) == mem.admit_tokens(a) == 50
    assert mem.fits(100) and not mem.fits(101)
    mem.admit(a)
    assert mem.used_tokens == 50 and mem.held_tokens(a) == 50
    a.generated = 19
    assert mem.can_grow(a)  # reserved up front: growth never needs memory
    mem.grow(a)
    assert mem.used_tokens == 50 and not mem.grows
    assert not mem.fits(51) and mem.fits(50)
    assert mem.free(a) == 50 and mem.used_tokens == 0


def test_peak_is_the_highest_use_and_survives_releases():
    mem = ReserveMemory(100)
    mem.hold(30)
    mem.hold(20)
    mem.release(40)
    mem.hold(5)
    assert mem.used_tokens == 15 and mem.peak_used_tokens == 50
    mem.hold(50)
    assert mem.peak_used_tokens == 65


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ReserveMemory(0), "kv_capacity_tokens must be >= 1"),
        (lambda: PagedMemory(0), "kv_capacity_tokens must be >= 1"),
        (lambda: PagedMemory(64, block_size_tokens=True), "block_size_tokens=True: must be an"),
        (lambda: PagedMemory(64, block_size_tokens=4.0), "block_size_tokens=4.0: must be an"),
        (lambda: PagedMemory(64, block_size_tokens=0), "block_size_tokens=0: must be in"),
        (lambda: PagedMemory(64, block_size_tokens=65), "block_size_tokens=65: must be in"),
        (lambda: PagedMemory(64, watermark=-0.01), r"watermark=-0.01: must be in \[0, 1\)"),
        (lambda: PagedMemory(64, watermark=1.0), r"watermark=1.0: must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(make, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        make()


def test_edge_settings_are_accepted():
    one = PagedMemory(1, block_size_tokens=1, watermark=0.0)  # the smallest cache: 1 block of 1
    assert (one.num_blocks, one.capacity_tokens) == (1, 1)
    whole = PagedMemory(64, block_size_tokens=64, watermark=0.5)
    assert whole.num_blocks == 1 and whole.admission_limit_tokens == 0
    assert ReserveMemory(1).capacity_tokens == 1


def test_build_memory_passes_the_settings_through():
    reserve = build_memory("reserve", 100)
    assert isinstance(reserve, ReserveMemory) and reserve.capacity_tokens == 100
    paged = build_memory("paged", 100, block_size_tokens=10, watermark=0.2)
    assert isinstance(paged, PagedMemory)
    assert (paged.block_size_tokens, paged.num_blocks, paged.watermark_blocks) == (10, 10, 2)
    default = build_memory("paged", 1600)
    assert (default.block_size_tokens, default.watermark_blocks) == (16, 1)
    assert isinstance(default, Memory) and default.name == "paged" and reserve.name == "reserve"


def test_paged_defaults_are_16_token_blocks_and_a_1_percent_watermark():
    mem = PagedMemory(1600)
    assert (mem.block_size_tokens, mem.num_blocks, mem.watermark_blocks) == (16, 100, 1)
    assert mem.admission_limit_tokens == 1584


def test_one_token_blocks_grow_by_every_token():
    mem = PagedMemory(10, block_size_tokens=1, watermark=0.0)
    a = seq(0, 3, 5)
    mem.admit(a)
    assert mem.used_tokens == 3
    for generated in range(1, 5):  # each decode writes one token: one more block
        a.generated = generated
        mem.grow(a)
        assert mem.used_tokens == 3 + generated and mem.blocks == {0: 3 + generated}
