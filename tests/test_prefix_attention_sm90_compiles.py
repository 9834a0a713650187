"""The Gluon prefix kernel compiles for sm_90 at every tiling it picks from, without a GPU (in a
process without Triton's interpreter, which the other tests switch on); its tiling, registers and
split plan."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
ROOT = Path(__file__).resolve().parents[1]


def test_gluon_prefix_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "scripts/compile_prefix_attention_sm90.py", "--sass-hash"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    from compile_prefix_attention_sm90 import TILINGS

    lines = [line for line in done.stdout.splitlines() if line.startswith("ok")]
    assert len(lines) == len(TILINGS), done.stdout
    assert all("local 0" in line for line in lines), done.stdout
    # No spills (ptxas's land in the stack frame) but where a tail warp group cuts the consumers'
    # registers: those tilings spill a little (the README's limits).
    spills = {line.split(" {")[0][7:]: int(line.split("stack (spills) ")[1].split(",")[0]) for line in lines}
    assert all(count == 0 for name, count in spills.items() if "tail" not in name), spills
    assert not any("OVER" in line for line in lines), done.stdout  # each fits its programs an SM
    hashes = [re.search(r"sass ([0-9a-f]{16}) \((\d+) instructions\)", line) for line in lines]
    assert all(h and int(h.group(2)) > 1000 for h in hashes), done.stdout  # the machine code, disassembled
    assert len({h.group(1) for h in hashes}) == len(lines), done.stdout  # each tiling its own code


def test_plan_splits_fills_whole_waves_with_few_splits():
    from ddtree.kernels.prefix_attention_sm90 import plan_splits

    assert plan_splits(24, 132, 32768) == 11  # 264 programs: two whole waves
    assert plan_splits(72, 132, 32768) == 9  # 648 in 5 waves, within 3% of 11's 792 in 6, with fewer partials
    assert plan_splits(120, 132, 32768) == 11  # 1320: ten whole waves
    assert plan_splits(24, 132, 2560) == 5  # at least 512 keys a split
    assert plan_splits(264, 132, 32768) == 1  # already whole waves


def test_tiling_takes_one_consumer_only_where_two_could_not_fill_the_sms():
    from ddtree.kernels.prefix_attention_sm90 import tiling

    assert tiling(128, rows=260, kv_heads=8, sms=132)["CONSUMERS"] == 2  # Qwen3-8B, 65 tokens: 3 x 8 x 16 >= 132
    assert tiling(128, rows=260, kv_heads=8, sms=132)["BLOCK_N"] == 128
    assert tiling(128, rows=68, kv_heads=8, sms=132) == {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 2}
    assert tiling(256, rows=102, kv_heads=4, sms=132) == {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 1}
    assert tiling(256, rows=390, kv_heads=4, sms=132) == {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1}


def test_registers_share_the_sm_and_leave_the_loader_24():
    from ddtree.kernels.prefix_attention_sm90 import registers

    for consumers, per_sm in ((2, 1), (1, 2), (1, 1)):
        maxnreg, consumer, tail = registers(consumers, per_sm)
        assert maxnreg % 8 == 0 and consumer % 8 == 0 and consumer <= 256 and tail == 0
        assert per_sm * (consumers + 1) * 128 * maxnreg <= 65536  # the launch fits the register file
        assert consumers * consumer + 24 <= (consumers + 1) * maxnreg  # setmaxnreg's budget holds
    assert registers(2, 1) == (168, 240, 0)
    # four warp groups: two consumers, the tail, the loader's warp launched with three more
    maxnreg, consumer, tail = registers(2, 1, tail=True)
    assert 4 * 128 * maxnreg <= 65536 and 256 * consumer + 128 * tail + 128 * 24 <= 65536
    assert (maxnreg, consumer, tail) == (128, 216, 56)


def test_the_tail_takes_at_most_16_rows_past_whole_blocks():
    from ddtree.kernels.prefix_attention_sm90 import tail_rows

    two = {"CONSUMERS": 2, "PER_SM": 1}
    assert tail_rows(two, 260, 128) == (8, 256)  # 65 tokens x 4 heads
    assert tail_rows(two, 1028, 128) == (8, 1024)  # 257 tokens
    assert tail_rows(two, 144, 128) == (16, 128)
    assert tail_rows(two, 145, 128) == (0, 145)  # 17 rows past: a row block of their own
    assert tail_rows(two, 256, 128) == (0, 256)
    assert tail_rows(two, 100, 128) == (0, 100)  # no whole block
    assert tail_rows(two, 390, 256) == (8, 384)  # Qwen3.6-27B, 65 tokens x 6 heads
    assert tail_rows(two, 1542, 256) == (0, 1542)  # 257 tokens: 12 whole blocks, past TAIL_256_MAX_BLOCKS
    assert tail_rows(two, 4 * 128 + 6, 256) == (8, 512)
    assert tail_rows(two, 138, 256) == (16, 128)  # 23 tokens
    assert tail_rows(two | {"TAIL": False}, 260, 128) == (0, 260)
    assert tail_rows({"CONSUMERS": 1, "PER_SM": 2}, 260, 128) == (0, 260)


def test_splits_for_counts_a_tilings_programs():
    from ddtree.kernels.prefix_attention_sm90 import plan_splits, splits_for

    two = {"CONSUMERS": 2, "PER_SM": 1}
    # 65 tokens at Qwen3-8B heads: two whole row blocks a KV head, the 4 rows past them a tail's
    assert splits_for(two, rows=260, kv_heads=8, sms=132, max_keys=32768, head_dim=128) == plan_splits(16, 132, 32768)
    assert splits_for(two | {"TAIL": False}, rows=260, kv_heads=8, sms=132, max_keys=32768,
                      head_dim=128) == plan_splits(24, 132, 32768) == 11
    # at head_dim 256: 65 tokens x 6 heads = 390 rows, three whole row blocks and a tail of 6 rows
    assert splits_for(two, rows=390, kv_heads=4, sms=132, max_keys=32768, head_dim=256) == plan_splits(12, 132, 32768)
    assert splits_for(two | {"TAIL": False}, rows=390, kv_heads=4, sms=132, max_keys=32768,
                      head_dim=256) == plan_splits(16, 132, 32768)
    one = {"CONSUMERS": 1, "PER_SM": 2}
    assert splits_for(one, rows=68, kv_heads=8, sms=132, max_keys=32768, head_dim=128) == plan_splits(16, 264, 32768)


@pytest.mark.parametrize("max_keys,splits,block_cols", [(33024, 8, 65), (33024, 2, 257), (33024, 11, 0), (5300, 4, 17),
                                                        (4096, 16, 384), (100, 1, 17), (9000, 7, 129)])
def test_split_keys_cover_the_prefix_once_and_even_out_the_first_split(max_keys, splits, block_cols):
    """Every prefix key up to max_keys in exactly one split, splits on 128-key boundaries; the first
    split gives up as many prefix keys as the block's columns take in 128-key tiles, so that no
    split reads more tiles than a whole split's worth (the first split's used to read the block's on
    top of them)."""
    from ddtree.kernels.prefix_attention_sm90 import SPLIT_KEYS, split_keys

    per, lead = split_keys(max_keys, splits, block_cols)
    assert per % SPLIT_KEYS == 0 and lead % SPLIT_KEYS == 0 and 0 <= lead - block_cols < SPLIT_KEYS
    bounds = [(max(s * per - lead, 0), min((s + 1) * per - lead, max_keys)) for s in range(splits)]
    covered = [key for lo, hi in bounds for key in range(lo, hi)]
    assert covered == list(range(max_keys))
    tiles = [max(hi - lo, 0) // SPLIT_KEYS + (lead // SPLIT_KEYS if s == 0 else 0) for s, (lo, hi) in enumerate(bounds)]
    assert max(tiles) <= per // SPLIT_KEYS  # the first split's block no longer runs past the others
    assert split_keys(max_keys, splits) == (-(-(-(-max_keys // splits)) // SPLIT_KEYS) * SPLIT_KEYS, 0)
