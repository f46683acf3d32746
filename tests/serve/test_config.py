"""``lapse serve``'s flags: a bad value fails in one line before any model loads."""

from __future__ import annotations

import pytest

from lapse.cli import main

RUN = "tests/fixtures/before_restructure/run-fox-pro"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give a run folder or --hf PATH"),
        ([RUN, "--kv-memory", "1", "--kv-pages", "8"], "give --kv-memory or --kv-pages, not both"),
        ([RUN, "--max-batch", "0"], "--max-batch must be at least 1"),
        ([RUN, "--port", "70000"], "--port must be in [0, 65535]"),
        ([RUN, "--budget", "0.5"], "--budget is not used by --policy dense"),
        ([RUN, "--gguf-file", "x.gguf"], "give --hf too"),
    ],
    ids=["no-model", "two-pools", "no-rows", "port", "unused-flag", "gguf-without-hf"],
)
def test_a_bad_flag_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
