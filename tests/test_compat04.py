"""Scripts written for expr-tracker 0.4 run unchanged: its other calls, as 0.4 documents them."""

from __future__ import annotations

from pathlib import Path

import pytest

import expr_tracker as et


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    et.init("p", "r", dir=tmp_path)
    for k in range(3):
        et.log({"loss": 1.0 / (k + 1)})
    et.finish()
    return tmp_path / "p" / "r"


@pytest.mark.parametrize(("alias", "kind"), [
    ("pandas", "DataFrame"), ("pd", "DataFrame"), ("df", "DataFrame"), ("PANDAS", "DataFrame"),
    ("arrow", "Table"), ("Arrow", "Table"), ("dict", "list"), ("records", "list"),
    ("list", "list"), ("Dict", "list"),
])
def test_history_and_read_run_take_0_4s_output_types(run_dir: Path, alias: str, kind: str) -> None:
    for got in (et.history(-1, run=run_dir, output_type=alias),
                et.read_run(run_dir, output_type=alias)):
        assert type(got).__name__ == kind
        rows = got if isinstance(got, list) else got.to_pylist() if kind == "Table" else got.to_dict("records")
        assert [r["loss"] for r in rows] == [1.0, 0.5, 1 / 3]


def test_an_unknown_output_type_lists_the_choices(run_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"output_type must be one of .*'pd'.*'records'.*got 'polars'"):
        et.history(-1, run=run_dir, output_type="polars")
    with pytest.raises(ValueError, match="output_type must be one of"):
        et.read_run(run_dir, output_type=3)


def test_dir_of_the_package_is_its_public_api() -> None:
    assert dir(et) == sorted(et.__all__)
    assert not {"os", "Any", "Mapping", "Sequence", "annotations"} & set(dir(et))


def test_a_backend_module_imported_without_a_spec_counts_as_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    import warnings

    from expr_tracker.backends.base import require

    fake = types.ModuleType("expr_fake_backend_lib")
    fake.__spec__ = None  # as a module some test harnesses or notebooks put in sys.modules
    monkeypatch.setitem(sys.modules, "expr_fake_backend_lib", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert require("expr_fake_backend_lib", "fake") is True


class Plugin04:
    """A backend as expr-tracker 0.4 documents them: init(run_info), log(row), finish()."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init(self, run_info):  # type: ignore[no-untyped-def]
        self.calls.append(("init", run_info))

    def log(self, row):  # type: ignore[no-untyped-def]
        self.calls.append(("log", row))

    def finish(self):  # type: ignore[no-untyped-def]
        self.calls.append(("finish", None))


def test_a_0_4_backend_object_gets_the_run_its_rows_and_the_finish(tmp_path: Path) -> None:
    plugin = Plugin04()
    et.init("p", "plug", dir=tmp_path, config={"lr": 0.1}, backends=[plugin])
    for k in range(3):
        et.log({"loss": float(k)})
    et.finish()
    kinds = [c[0] for c in plugin.calls]
    assert kinds == ["init", "log", "log", "log", "finish"], kinds
    info = plugin.calls[0][1]
    assert isinstance(info, dict)
    assert (info["project"], info["name"], info["config"]) == ("p", "plug", {"lr": 0.1})
    rows = [c[1] for c in plugin.calls if c[0] == "log"]
    assert [(r["_step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_an_object_that_is_no_backend_is_refused_naming_both_protocols(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"open/log/alert/finish methods \(or 0\.4's init/log/finish\)"):
        et.init("p", "bad", dir=tmp_path, backends=[object()])


def test_alert_channels_as_0_4_list_with_a_callable(tmp_path: Path) -> None:
    got: list[dict] = []

    def boom(alert: dict) -> None:
        raise RuntimeError("the notebook's channel is broken")

    run = et.init("p", "al", dir=tmp_path, alert={"channels": [
        {"type": "callable", "callable": got.append, "name": "mine"}, boom]},
        alert_rules=["loss > 1 => warning: high loss"])
    et.log({"loss": 2.0})
    et.alert("manual", "by hand", level="error")
    et.finish()  # waits for delivery (exit_timeout)
    titles = sorted(a["title"] for a in got)
    assert titles == ["high loss", "manual"], got
    assert all(a["project"] == "p" and "level" in a for a in got)
    # the function that raised: counted as a failure, never raised into the script
    stats = run.info()["alerts"]
    assert stats["mine"]["sent"] == 2 and stats["callable1"] == {**stats["callable1"], "failed": 2}


def test_a_callable_channel_is_refused_in_spool_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="callable channel runs in this process"):
        et.init("p", "sp", dir=tmp_path, upload_mode="spool", spool_dir=tmp_path / "spool",
                alert={"channels": [print]})


def test_a_channel_list_entry_that_is_neither_table_nor_function_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"channels\[1\] must be a table or a function"):
        et.init("p", "x", dir=tmp_path, alert={"channels": [{"type": "log"}, 3]})


def _spooled_backends(tmp_path: Path, name: str) -> object:
    import json

    run = et.init("p", name, dir=tmp_path / "runs", upload_mode="spool", spool_dir=tmp_path / "spool")
    spool_file = Path(run.info()["spool_file"])
    et.finish()
    return json.loads(spool_file.read_text().splitlines()[0])["backends"]


def test_a_site_restores_0_4s_default_backend_with_expr_backends(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert _spooled_backends(tmp_path, "none") == []  # no network unless asked
    monkeypatch.setenv("EXPR_BACKENDS", "wandb, trackio")
    assert _spooled_backends(tmp_path, "env") == ["wandb", "trackio"]
    monkeypatch.delenv("EXPR_BACKENDS")
    conf = tmp_path / "alerts.toml"
    conf.write_text('[defaults]\nbackends = ["wandb"]\n\n[channels.ops]\ntype = "log"\n')
    monkeypatch.setenv("EXPR_ALERT_CONFIG", str(conf))
    assert _spooled_backends(tmp_path, "file") == ["wandb"]
    conf.write_text('[defaults]\nbackends = "wandb"\n')
    with pytest.raises(ValueError, match=r"\[defaults\] backends must be a list of names"):
        et.init("p", "bad", dir=tmp_path / "runs", upload_mode="spool", spool_dir=tmp_path / "spool")


SCRIPT_04 = """
import dataclasses, sys
import expr_tracker as et

@dataclasses.dataclass
class Cfg:
    lr: float = 3e-4
    layers: int = 2

run = et.init("proj", "legacy", run_dir=sys.argv[1], config=Cfg(), tags=["baseline", "a100"],
              notes="first try", entity="team-a", step_policy="allow")
for step in range(5):
    et.log({"loss": 1.0 / (step + 1), "acc": step / 10}, step=step)
print(sorted(et.history(2, output_type="records")[-1]))
print(sorted(et.history(2, include_meta=False)[-1]))
et.log({"late": 1.0}, step=1)  # out of order: kept with step_policy="allow"
run.summary["best_acc"] = 0.4
et.summary({"note": "done"})
et.finish(exit_code=int(sys.argv[2]))
et.finish()  # idempotent; and without a run it does nothing
"""


def _run_script(tmp_path: Path, code: int, env: dict[str, str] | None = None) -> list[str]:
    import subprocess
    import sys

    from tests.procs import env_for

    done = subprocess.run([sys.executable, "-c", SCRIPT_04, str(tmp_path), str(code)],
                          env=env_for(env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_0_4_script_runs_unchanged_and_leaves_what_0_4_promises(tmp_path: Path) -> None:
    import json

    out = _run_script(tmp_path, 1)
    assert out == ["['_step', '_time', 'acc', 'loss']", "['_step', 'acc', 'loss']"], out
    run = tmp_path / "proj" / "legacy"
    side = json.loads((run / "metrics.meta.json").read_text())
    assert side["config"] == {"lr": 3e-4, "layers": 2}
    assert (side["tags"], side["notes"], side["entity"]) == (["baseline", "a100"], "first try", "team-a")
    # finish(exit_code=1): crashed, with the code
    assert side["status"] == "crashed" and side["exit"]["code"] == 1, side
    # the last logged value of each key, yours over them
    assert side["summary"] == {"_step": 4, "loss": 0.2, "acc": 0.4, "late": 1.0,
                               "best_acc": 0.4, "note": "done"}, side["summary"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the out-of-order row is kept (written at once; step 4 stayed open until finish)
    assert [r["_step"] for r in rows] == [0, 1, 2, 3, 1, 4]


def test_the_summary_is_saved_by_the_exit_hook_too(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.procs import env_for

    code = ("import sys, expr_tracker as et\n"
            "et.init('p', 'hook', dir=sys.argv[1])\n"
            "et.log({'loss': 0.5}); et.log({'loss': 0.25})\n"
            "et.get_run().summary['best'] = 0.25\n")  # no finish: the exit hook finishes
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env_for(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    side = json.loads((tmp_path / "p" / "hook" / "metrics.meta.json").read_text())
    assert side["status"] == "finished" and side["summary"] == {"_step": 1, "loss": 0.25, "best": 0.25}


def test_the_summary_tags_and_exit_code_travel_through_exprd(tmp_path: Path) -> None:
    import json

    from tests.test_daemon import exprd_once, write_config

    spool, root = tmp_path / "spool", tmp_path / "runs"
    _run_script(root, 3, {"EXPR_MODE": "spool", "EXPR_SPOOL": str(spool)})
    exprd_once(write_config(tmp_path / "exprd.toml", spool, tmp_path / "state", [root]))
    side = json.loads((root / "proj" / "legacy" / "metrics.meta.json").read_text())
    assert side["status"] == "crashed" and side["exit"]["code"] == 3
    assert side["tags"] == ["baseline", "a100"] and side["summary"]["best_acc"] == 0.4
    assert side["summary"]["loss"] == 0.2


def test_pydantic_config_and_backend_kwargs(tmp_path: Path) -> None:
    import json

    pydantic = pytest.importorskip("pydantic")

    class Cfg(pydantic.BaseModel):
        lr: float = 0.1
        name: str = "x"

    run = et.init("p", "pyd", dir=tmp_path / "runs", config=Cfg(), upload_mode="spool",
                  spool_dir=tmp_path / "spool", backends=["http"],
                  backend_kwargs={"http": {"url": "http://127.0.0.1:9/ingest", "batch": 10}})
    first = json.loads(Path(run.info()["spool_file"]).read_text().splitlines()[0])
    et.finish()
    assert first["identity"]["config"] == {"lr": 0.1, "name": "x"}
    # merged into the spec (a URL stays out of the spool: exprd's config has it)
    assert first["backends"] == [{"type": "http", "batch": 10}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tags": "a"}, "tags must be a list of strings"),
    ({"tags": [""]}, "tags must be at most 64 non-empty strings"),
    ({"notes": 3}, "notes must be a string"),
    ({"entity": "a b"}, "entity"),
    ({"step_policy": "keep"}, "step_policy must be one of drop, allow"),
    ({"run_dir": "x", "dir": "y"}, "dir and run_dir are the same setting"),
    ({"backend_kwargs": {"wandb": {}}}, "backend_kwargs: wandb is not among the backends"),
    ({"config": object()}, "config must be a dict, a dataclass or a pydantic model"),
])
def test_bad_0_4_arguments_name_the_field(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        et.init("p", "bad", **{"dir": tmp_path, **kwargs})
    assert not (tmp_path / "p").exists()  # nothing half-written


def test_finish_exit_code_must_be_an_int(tmp_path: Path) -> None:
    et.init("p", "ec", dir=tmp_path)
    with pytest.raises(TypeError, match="exit_code must be an int"):
        et.finish(exit_code="1")  # type: ignore[arg-type]
    et.finish()
