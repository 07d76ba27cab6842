"""`kubetrain validate` reads a file as kubectl does: YAML as go-yaml v2 types it, no repeated keys or exotic tags,
every document, every item of a List, and generateName in place of a name."""

import math

import pytest
import yaml

from kubetrain.core.cli import main
from kubetrain.core.validate import ManifestError, load_documents, load_job

JOB = "apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: %s}\nspec: {workers: %s}\n"
SWEEP = ("apiVersion: kubetrain.io/v1alpha1\nkind: TrainingSweep\nmetadata: {name: lr}\nspec:\n"
         "  template: {spec: {maxSteps: 200, optimizer: {minLr: 0}}}\n  parameters: [{path: optimizer.lr, low: 0.0001, high: 0.1, log: true}]\n")


def read(tmp_path, text):
    f = tmp_path / "m.yaml"
    f.write_text(text)
    return load_documents(f)


@pytest.mark.parametrize(("plain", "value"), [
    ("1:30", "1:30"),  # no base-60: PyYAML reads 90
    ("12:30:00", "12:30:00"),
    ("on", True), ("yes", True), ("y", True), ("Y", True), ("TRUE", True), ("off", False), ("No", False), ("n", False),
    ("tRUE", "tRUE"),
    ("0777", 511), ("0o17", 15), ("0x1F", 31), ("0b101", 5), ("1_000", 1000), ("+5", 5), ("-0x10", -16), ("00", 0),
    ("08", 8.0),  # not octal, so Go's float
    ("1e18", 1e18), ("3e-4", 3e-4), (".5", 0.5), ("1.", 1.0), (".inf", math.inf), ("-.Inf", -math.inf),
    ("2024-01-01", "2024-01-01"), ("2001-12-14t21:59:43.10-05:00", "2001-12-14t21:59:43.10-05:00"),
    ("~", None), ("Null", None), ("", None), ("=", "="), ("0.1.2", "0.1.2"), ("1e", "1e"), ("0x", "0x"),
])
def test_plain_scalars_are_typed_as_kubectl_types_them(plain, value, tmp_path):
    (doc,) = read(tmp_path, f"a: {plain}\n")
    assert doc["a"] == value and type(doc["a"]) is type(value)


def test_nan_is_a_float_the_api_server_then_refuses(tmp_path):
    (doc,) = read(tmp_path, "a: .NaN\n")
    assert math.isnan(doc["a"])


@pytest.mark.parametrize(("tagged", "value"), [
    ("!!str 5", "5"), ("!!int '0x10'", 16), ("!!float 1", 1.0), ("!!bool on", True), ("!!null ''", None),
    ("!!map {b: 1}", {"b": 1}), ("!!seq [1]", [1]),
])
def test_the_core_tags_are_read(tagged, value, tmp_path):
    assert read(tmp_path, f"a: {tagged}\n") == [{"a": value}]


@pytest.mark.parametrize(("tagged", "short"), [
    ("!!timestamp 2024-01-01", "!!timestamp"), ("!!binary aGk=", "!!binary"), ("!!set {x}", "!!set"),
    ("!!omap [{x: 1}]", "!!omap"), ("!!python/name:os.system ''", "!!python/name:os.system"), ("!local x", "!local"),
])
def test_other_tags_are_refused_at_their_path(tagged, short, tmp_path):
    with pytest.raises(ManifestError) as err:
        read(tmp_path, f"spec:\n  env:\n    - {{name: A, value: {tagged}}}\n")
    assert [str(p) for p in err.value.problems] == [
        f"spec.env[0].value: tag {short} (line 3) is not one of YAML's core tags (!!str, !!int, !!float, !!bool, "
        "!!null, !!map, !!seq): YAML readers disagree on what the others mean"]


def test_a_bad_scalar_under_a_core_tag_is_one_line(tmp_path):
    with pytest.raises(ManifestError) as err:
        read(tmp_path, "a: !!int twelve\n")
    assert [str(p) for p in err.value.problems] == [
        "(file): not valid YAML: cannot read 'twelve' as !!int (line 1, column 4)"]


@pytest.mark.parametrize(("text", "line"), [
    ("spec:\n  env:\n    - {name: A, value: x, name: B}\n", "spec.env[0].name: duplicate key (line 3)"),
    ("a: {yes: 1, true: 2}\n", "a.true: duplicate key (line 1)"),  # both the boolean true, to kubectl
    ("a: {0x10: 1, 16: 2}\n", "a.16: duplicate key (line 1)"),
    ("a: 1\n---\nb: 1\nb: 2\n", "b: duplicate key (line 4)"),  # in the second document: the line says where
])
def test_a_key_set_twice_is_refused_with_its_path_and_line(text, line, tmp_path):
    with pytest.raises(ManifestError) as err:
        read(tmp_path, text)
    assert [str(p) for p in err.value.problems] == [f"{line}: kubectl refuses a mapping that sets a key twice"]


def test_merge_keys_and_keys_of_other_types_are_not_duplicates(tmp_path):
    docs = read(tmp_path, "base: &b {p: 1, q: 2}\nuse: {<<: *b, q: 3}\nkeys: {1: a, '1': b, 1.0: c}\n")
    assert docs[0]["use"] == {"p": 1, "q": 3}


def test_y_and_n_keys_are_booleans_to_kubectl(tmp_path):
    """go-yaml v2's YAML 1.1 booleans include y and n, keys too: `{y: 1}` reaches the API server as {"true": 1}."""
    assert read(tmp_path, "a: {y: 1, n: 2, x: 3}\n") == [{"a": {True: 1, False: 2, "x": 3}}]


def test_an_alias_cycle_is_walked_once(tmp_path):
    assert read(tmp_path, "a: &a [*a]\n")[0]["a"][0][0][0] is not None


def test_every_document_is_judged_and_other_kinds_beside_them_are_left_to_kubectl(tmp_path, capsys):
    f = tmp_path / "all.yaml"
    f.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: ml}\n---\n" + JOB % ("a", 2) + "---\n" + SWEEP)
    assert main(["validate", str(f)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{f}[0]: not checked (not a kubetrain kind): Namespace 'ml'",
        f"{f}[1]: valid TrainingJob 'a'",
        f"{f}[2]: valid TrainingSweep 'lr'",
    ]


def test_a_bad_document_among_several_is_named_by_its_index(tmp_path, capsys):
    f = tmp_path / "two.yaml"
    f.write_text(JOB % ("a", 2) + "---\n" + JOB % ("b", 0))
    assert main(["validate", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{f}[1]: spec.workers: must be >= 1"]


def test_a_file_of_other_kinds_only_is_judged_as_training_jobs(tmp_path, capsys):
    f = tmp_path / "ns.yaml"
    f.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: ml}\n")
    assert main(["validate", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{f}: apiVersion: must be kubetrain.io/v1alpha1", f"{f}: kind: must be TrainingJob"]


@pytest.mark.parametrize("kind", ["List", "TrainingJobList"])
def test_every_item_of_a_list_is_judged(kind, tmp_path, capsys):
    items = [yaml.safe_load(JOB % (name, 2)) for name in ("a", "b")]
    f = tmp_path / "list.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": kind, "items": items}))
    assert main(["validate", str(f)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{f}: items[0]: valid TrainingJob 'a'", f"{f}: items[1]: valid TrainingJob 'b'"]


def test_an_empty_list_holds_no_training_job(tmp_path, capsys):
    f = tmp_path / "empty.yaml"
    f.write_text("apiVersion: v1\nkind: List\nitems: []\n")
    assert main(["validate", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{f}: (file): holds no TrainingJob"]


GENERATED = "apiVersion: kubetrain.io/v1alpha1\nkind: %s\nmetadata: {generateName: %s}\n"


def test_generate_name_stands_in_for_a_name(tmp_path, capsys):
    f = tmp_path / "gen.yaml"
    f.write_text(GENERATED % ("TrainingJob", "train-") + "spec: {workers: 2}\n")
    assert main(["validate", str(f)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{f}: valid TrainingJob generateName 'train-'"]
    assert load_job(f).metadata.name == "train"  # a local run's output directory stays the same run to run


@pytest.mark.parametrize(("kind", "longest"), [("TrainingJob", 45), ("TrainingSweep", 41)])
def test_generate_name_leaves_room_for_the_random_characters(kind, longest, tmp_path, capsys):
    spec = "spec: {}\n" if kind == "TrainingJob" else SWEEP.split("metadata: {name: lr}\n")[1]
    ok, long = tmp_path / "ok.yaml", tmp_path / "long.yaml"
    ok.write_text(GENERATED % (kind, "g" * (longest - 1) + "-") + spec)
    long.write_text(GENERATED % (kind, "g" * longest + "-") + spec)
    assert main(["validate", str(ok)]) == 0
    assert main(["validate", str(long)]) == 2
    limit = longest + 5
    assert capsys.readouterr().err.splitlines() == [
        f"{long}: metadata.generateName: must have at most {longest} characters (the API server appends 5 random "
        f"characters to make the name, which has at most {limit})"]


def test_a_name_or_generate_name_is_required(tmp_path, capsys):
    f = tmp_path / "anon.yaml"
    f.write_text("apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {generateName: ''}\nspec: {}\n")
    assert main(["validate", str(f)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{f}: metadata.name: required"]


def test_run_takes_one_job_and_says_so(tmp_path, capsys):
    two = tmp_path / "two.yaml"
    two.write_text(JOB % ("a", 1) + "---\n" + JOB % ("b", 1))
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(JOB % ("a", 1))]}))
    assert main(["run", str(two)]) == 2
    assert main(["run", str(listed)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{two}: (file): must hold exactly one TrainingJob, found 2",
        f"{listed}: (file): holds a List: give the TrainingJob on its own (kubetrain validate checks every item of a "
        "List)"]


def test_run_refuses_a_bad_env_name_with_one_line_not_a_traceback(tmp_path, capsys):
    f = tmp_path / "env.yaml"
    f.write_text("apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: env}\n"
                 "spec: {env: [{name: A=B, value: x}]}\n")
    assert main(["run", str(f), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{f}: spec.env[0]: name 'A=B' is not a variable name: printable ASCII characters other than '='"]
    assert not (tmp_path / "out").exists()
