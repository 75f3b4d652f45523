"""How a bench program refuses, checked the same way in each bench's tests: bad arguments end in one line on stderr
and exit 2 (argparse's `error`), a CUDA-only program on a machine without a CUDA GPU says so and exits 1."""
from __future__ import annotations

import pytest


def assert_refused(main, argv: list[str], message: str, capsys) -> None:
    """main(argv) exits 2 with `message` on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def assert_needs_a_gpu(main, argv: list[str]) -> None:
    """main(argv) exits with a message that names the missing CUDA GPU (SystemExit's message: exit status 1)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert "no CUDA GPU" in str(e.value.code)
