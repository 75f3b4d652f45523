"""The suite's own set-up: a subprocess meets SIGINT as from a terminal (tests/conftest.py), so the Ctrl-C tests
hold however pytest was started (a shell's background job starts with SIGINT ignored)."""
import signal
import subprocess
import sys


def test_a_subprocess_of_the_suite_gets_a_keyboard_interrupt_handler():
    done = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "default_int_handler", done
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN
