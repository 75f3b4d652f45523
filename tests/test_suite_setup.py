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


def test_files_with_more_slow_tests_go_first_each_kept_whole_and_in_order():
    from types import SimpleNamespace

    from tests.conftest import slow_files_first

    def item(path, slow):
        return SimpleNamespace(path=path, name=f"{path}{slow}", get_closest_marker=lambda m: (m == "slow" and slow) or None)

    items = [item("a", 0), item("a", 0), item("b", 1), item("b", 0), item("c", 1), item("c", 1), item("d", 0)]
    assert [(i.path, i.name) for i in slow_files_first(items)] == [
        ("c", "c1"), ("c", "c1"), ("b", "b1"), ("b", "b0"), ("a", "a0"), ("a", "a0"), ("d", "d0")]
