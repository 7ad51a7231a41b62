"""Sizes on the command line are bounded before anything is allocated: a flag over its maximum
is an argparse error naming it, and a demo that would not fit in memory is refused naming the
flags that size it."""

from __future__ import annotations

import pytest

from kvcore.cli import main as kvcore_cli


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--batch", str(10**12)],
     "argument --batch: 1000000000000 is more than 1024 (the demo's most"),
    (["demo", "--block-size", str(10**12)], "argument --block-size: 1000000000000 is more than"),
    (["demo", "--new-tokens", "1000000"], "argument --new-tokens: 1000000 is more than 4096"),
    (["demo", "--max-num-seqs", "100000"], "argument --max-num-seqs: 100000 is more than 1024"),
    (["demo", "--seed", str(10**23)], "argument --seed: 100000000000000000000000 is more than "
                                      "4294967295 (seeds are 32-bit)"),
    (["layout", "TRITON_ATTN", "--show-blocks", str(10**12)],
     "argument --show-blocks: 1000000000000 is more than 32 (a readable table or picture)"),
    (["layout", "TRITON_ATTN", "--show-layers", "100000"], "argument --show-layers: 100000 is"),
    (["layout", "TRITON_ATTN", "--num-blocks", str(10**12)],
     "argument --num-blocks: 1000000000000 is more than 2147483647 (block tables hold int32"),
    (["warmup", "--max-num-seqs", "100000"], "argument --max-num-seqs: 100000 is more than"),
])
def test_a_size_over_its_maximum_is_refused_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        kvcore_cli(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_demo_larger_than_the_free_memory_is_refused_before_it_allocates(capsys):
    argv = ["demo", "--model", "large", "--batch", "1024", "--new-tokens", "4096",
            "--platform", "cpu", "--no-progress"]
    assert kvcore_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --batch 1024 --new-tokens 4096 --max-num-seqs 4 --block-size "
                          "16: the demo would need about ")
    assert "GB of device and host memory for the large model but" in err
    assert "lower --batch or --new-tokens" in err
