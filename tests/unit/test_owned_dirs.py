"""kubetrain deletes only what it wrote: a user's directory named as a run's checkpoint or output
directory is refused with every file intact; a fresh start clears only kubetrain's own directories."""

import json
from pathlib import Path

import pytest
import yaml

from kubetrain.core import cli, owned_dirs
from kubetrain.core.contract import OWNED_DIR_MARKER


def manifest(tmp_path: Path, **spec) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
        "spec": {"workers": 1, "maxSteps": 1, "command": ["python", "-c", "pass"], **spec}}))
    return path


def users_dir(path: Path) -> Path:
    (path / "thesis").mkdir(parents=True)
    (path / "thesis" / "chapter1.tex").write_text("years of work")
    (path / "notes.txt").write_text("keep me")
    return path


def intact(path: Path) -> bool:
    return ((path / "thesis" / "chapter1.tex").read_text() == "years of work"
            and (path / "notes.txt").read_text() == "keep me" and not (path / OWNED_DIR_MARKER).exists())


@pytest.mark.parametrize("fresh", [[], ["--fresh"]])
def test_a_users_directory_as_checkpoint_dir_is_refused_and_survives(tmp_path, capsys, fresh):
    victim = users_dir(tmp_path / "victim")
    job = manifest(tmp_path, checkpoint={"dir": str(victim)})
    assert cli.main(["run", str(job), "--output-dir", str(tmp_path / "out"), "-q", *fresh]) == 2
    err = capsys.readouterr().err
    assert f"spec.checkpoint.dir: {victim} already holds files kubetrain did not write (notes.txt, thesis)" in err
    assert intact(victim)


def test_a_users_directory_as_output_dir_is_refused_and_survives(tmp_path, capsys):
    home = users_dir(tmp_path / "home")
    (home / "logs").mkdir()
    (home / "logs" / "server.log").write_text("mine")
    assert cli.main(["run", str(manifest(tmp_path)), "--output-dir", str(home), "-q", "--fresh"]) == 2
    assert f"--output-dir: {home} already holds files kubetrain did not write (notes.txt, thesis)" in (
        capsys.readouterr().err)
    assert intact(home) and (home / "logs" / "server.log").read_text() == "mine"


def test_a_fresh_run_clears_only_what_the_last_run_wrote(tmp_path):
    out, elsewhere = tmp_path / "out", users_dir(tmp_path / "elsewhere")
    job = manifest(tmp_path)
    assert cli.main(["run", str(job), "--output-dir", str(out), "-q"]) == 0
    assert (out / OWNED_DIR_MARKER).is_file() and (out / "checkpoints" / OWNED_DIR_MARKER).is_file()
    (out / "checkpoints" / "snapshot.pt").write_text("the job's own")  # what a custom script keeps there
    (out / "checkpoints" / "link").symlink_to(elsewhere)  # a link is removed, its target never entered
    (out / "mine.txt").write_text("a user's file dropped into the output directory")
    assert cli.main(["run", str(job), "--output-dir", str(out), "-q", "--fresh"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [OWNED_DIR_MARKER]
    assert (out / "mine.txt").is_file() and intact(elsewhere)
    assert json.loads((out / "summary.json").read_text())["phase"] == "Succeeded"


def test_a_run_of_a_release_without_the_marker_is_adopted(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "step-00000005").mkdir(parents=True)
    (out / "checkpoints" / "step-00000005" / "COMMITTED").write_text("{}")
    (out / "checkpoints" / ".best-eval.json.x1.tmp").write_text("")
    for name in ("progress.json", "losses.jsonl", "summary.json"):
        (out / name).write_text("{}")
    (out / "logs" / "gen-0").mkdir(parents=True)
    assert cli.main(["run", str(manifest(tmp_path)), "--output-dir", str(out), "-q", "--fresh"]) == 0
    assert not (out / "checkpoints" / "step-00000005").exists()
    assert (out / OWNED_DIR_MARKER).is_file() and (out / "checkpoints" / OWNED_DIR_MARKER).is_file()


def test_clear_never_deletes_in_a_directory_kubetrain_did_not_create(tmp_path):
    victim = users_dir(tmp_path / "victim")
    with pytest.raises(owned_dirs.NotOwnedError, match="was not created by kubetrain: nothing in it is deleted"):
        owned_dirs.clear(victim)
    assert intact(victim)


def test_an_empty_directory_is_adopted_and_a_file_in_its_place_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    owned_dirs.claim(tmp_path / "empty", "spec.checkpoint.dir")
    assert owned_dirs.owned(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(owned_dirs.NotOwnedError, match="spec.checkpoint.dir: cannot create .*file"):
        owned_dirs.claim(tmp_path / "file", "spec.checkpoint.dir")


def test_a_long_list_of_foreign_files_is_named_in_part(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}").write_text("")
    with pytest.raises(owned_dirs.NotOwnedError, match=r"\(f0, f1, f2, f3, f4 and 3 more\)"):
        owned_dirs.claim(tmp_path, "--output-dir")


def test_a_sweep_output_dir_holding_a_users_files_is_refused(tmp_path, capsys):
    home = users_dir(tmp_path / "home")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
        "spec": {"objective": {"metric": "loss", "goal": "minimize"}, "maxTrials": 1,
                 "parameters": [{"path": "optimizer.lr", "type": "float", "low": 0.001, "high": 0.01}],
                 "template": {"spec": {"maxSteps": 1}}}}))
    assert cli.main(["sweep", str(sweep), "--output-dir", str(home), "--fresh"]) != 0
    assert f"--output-dir: {home} already holds files kubetrain did not write" in capsys.readouterr().err
    assert intact(home)
