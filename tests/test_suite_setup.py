"""The suite's own set-up (tests/conftest.py): a subprocess meets SIGINT as from a terminal, so the Ctrl-C tests hold
however pytest was started (a shell's background job starts with SIGINT ignored); an expensive fixture directory is
built once per run."""
import signal
import subprocess
import sys

from tests.conftest import built_once


def test_a_subprocess_of_the_suite_gets_a_keyboard_interrupt_handler():
    done = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "default_int_handler", done
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN


def test_built_once_builds_a_directory_once_and_hands_it_to_every_caller(tmp_path_factory):
    calls = []

    def build(out):
        calls.append(out)
        out.mkdir()
        (out / "weights").write_text("built")

    first = built_once(tmp_path_factory, "once-check", build)
    again = built_once(tmp_path_factory, "once-check", build)
    assert first == again == calls[0] and len(calls) == 1 and (first / "weights").read_text() == "built"
