"""A build killed by SIGKILL leaves its hidden temporary directory; the next build of that corpus removes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import open_corpus

SRC = Path(__file__).resolve().parents[2] / "src"

KILLED_BUILD = """
import os, signal, sys
from hydraulis.data.build import corpus

def documents():
    for i in range(3000):
        if i == 2500:  # past the first chunk: tokens are on disk in the temporary directory
            os.kill(os.getpid(), signal.SIGKILL)
        yield f"document {i} " * 5

corpus.build_corpus(documents(), sys.argv[1], "bytes", source="killed", workers=1)
"""


def temporary(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.*.tmp"))


def test_next_build_removes_what_a_killed_build_left(tmp_path: Path, capsys) -> None:
    out = tmp_path / "corpus"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(out)], env=env, capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr
    left = temporary(tmp_path, "corpus")
    assert len(left) == 1 and (left[0] / "tokens.bin").stat().st_size > 0
    assert (tmp_path / ".corpus.parts" / "0.json").is_file()  # a finished part, kept for the next build
    assert not out.exists()
    build_corpus(["a", "bb"], out, "bytes", source="again")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted build" in err[0]
    assert temporary(tmp_path, "corpus") == []
    assert not (tmp_path / ".corpus.parts").exists()  # another source's build: the parts are not its own
    assert len(open_corpus(out)) == 2
