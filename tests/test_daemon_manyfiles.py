"""exprd's per-file shortcuts (issue 24 item 5: 2,048 live spool files) give the answers
of the slow paths they replace: the allowed_roots check by text, the run root resolved
once a few seconds, the run directory told by two lstats, a writer looked at once per
pass. Real files and symlinks; the daemon-level behaviour is in test_daemon*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from exprd.config import Config
from exprd.spec import InitError, Roots, _resolved_run_dir, check_init

from expr_tracker.procs import pid_alive, proc_start
from expr_tracker.store.layout import run_dir


def test_allows_and_root_of_agree_with_pathlib() -> None:
    roots = ["/", "/a", "/a/b", "/ab", "//x", "//", "/a/b/"]
    paths = ["/", "/a", "/a/b", "/a/bc", "/ab", "/ab/c", "/a/b/c/d", "/abc", "//x/y", "//x",
             "/x", "//", "///a", "/a/./b/c", "/a/b/../c"]
    for top in roots:
        root = Path(top)
        cfg = Config(allowed_roots=[root, Path("/zz")])
        for text in paths:
            path = Path(text)
            under = path == root or root in path.parents
            assert cfg.allows(path) == under, (top, text)
            assert cfg.root_of(path) == (root if under else None), (top, text)


def test_the_run_dir_by_two_lstats_is_its_resolution(tmp_path: Path) -> None:
    root = (tmp_path / "runs").resolve()
    outside = tmp_path / "outside"
    for d in (root / "real" / "run", root / "inner", outside / "run"):
        d.mkdir(parents=True)
    (root / "link-out").symlink_to(outside)
    (root / "link-in").symlink_to(root / "inner")
    (root / "real" / "named").symlink_to(outside / "run")
    (root / "file").write_text("x")
    (root / "dangling").symlink_to(tmp_path / "nowhere")
    cases = [("real", "run"), ("real", "missing"), ("missing", "run"), ("link-out", "run"),
             ("link-in", "x"), ("real", "named"), ("file", "run"), ("dangling", "run")]
    for project, name in cases:
        rdir = run_dir(root, project, name)
        assert _resolved_run_dir(rdir, root, project, name) == rdir.resolve(), (project, name)


def test_run_roots_are_resolved_again_after_their_time(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    link = tmp_path / "link"
    link.symlink_to(a)
    now = [100.0]
    roots = Roots(ttl=5.0, clock=lambda: now[0])
    assert roots.resolve(str(link)) == a.resolve()
    link.unlink()
    link.symlink_to(b)
    now[0] += 4.0
    assert roots.resolve(str(link)) == a.resolve()  # within its time: as it was
    now[0] += 1.5
    assert roots.resolve(str(link)) == b.resolve()
    link.unlink()
    link.symlink_to(a)
    roots.clear()  # a reload
    assert roots.resolve(str(link)) == a.resolve()


def _init(spool: Path, raw_dir: str, name: str = "n") -> tuple[dict[str, object], Path]:
    ev = {"_event": "init", "_seq": 0, "_time": 1.0, "version": 1, "dir": raw_dir,
          "identity": {"project": "p", "name": name, "session": "s1", "rank": 0,
                       "world_size": 1}}
    return ev, spool / "p" / name / "metrics.s1.jsonl"


def test_check_init_refuses_what_it_refused_and_takes_what_it_took(tmp_path: Path) -> None:
    spool, root, outside = tmp_path / "spool", tmp_path / "runs", tmp_path / "outside"
    for d in (spool, root / "p", outside / "n"):
        d.mkdir(parents=True)
    cfg = Config(allowed_roots=[root.resolve()])
    roots = Roots()
    ev, path = _init(spool, str(root))
    spec = check_init(ev, path, spool, cfg, roots)
    assert spec.paths.run_dir == root.resolve() / "p" / "n" and spec.anchor == root.resolve()
    (root / "p" / "evil").symlink_to(outside / "n")  # the run dir a symlink out of the root
    ev, path = _init(spool, str(root), "evil")
    with pytest.raises(InitError, match="outside allowed_roots"):
        check_init(ev, path, spool, cfg, roots)
    ev, path = _init(spool, str(outside))
    with pytest.raises(InitError, match="outside allowed_roots"):
        check_init(ev, path, spool, cfg, roots)
    ev, path = _init(spool, str(root))
    with pytest.raises(InitError, match="init identity says"):
        check_init(ev, spool / "p" / "other" / "metrics.s1.jsonl", spool, cfg, roots)


def test_pid_alive_reads_the_start_time_from_its_own_read() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = proc_start(child.pid)
        assert start is not None
        assert pid_alive(child.pid, start) and pid_alive(child.pid)
        assert not pid_alive(child.pid, start + 1)  # a recycled pid: another start time
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid, start)
    assert pid_alive(os.getpid(), proc_start(os.getpid()))
