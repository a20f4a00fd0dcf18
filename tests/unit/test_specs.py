import pytest

from factory import recipes
from factory.engines.awq.spec import AwqSpec, resolve
from factory.engines.exl2.spec import Exl2Spec
from factory.engines.gguf.spec import GgufTargets
from factory.errors import SpecError
from factory.specs import parse_bpw_list


@pytest.mark.parametrize("bpw", [2.0, 4.31, 8.0, "5"])
def test_bpw_in_range(bpw):
    assert Exl2Spec(bpw=bpw).bpw == float(bpw)


@pytest.mark.parametrize(
    "bpw, message",
    [
        (1.99, "bpw 1.99 is outside [2.0, 8.0]"),
        (8.5, "bpw 8.5 is outside [2.0, 8.0]"),
        ("abc", "bpw 'abc' is not a number; use a number in [2.0, 8.0]"),
        ("nan", "bpw nan is outside [2.0, 8.0]"),
    ],
)
def test_bpw_refused(bpw, message):
    with pytest.raises(SpecError) as e:
        Exl2Spec(bpw=bpw)
    assert e.value.message == message


@pytest.mark.parametrize("head", [1, 7, 16, True])
def test_head_bits_refused(head):
    with pytest.raises(SpecError, match="use one of 2, 3, 4, 5, 6, 8"):
        Exl2Spec(bpw=4.0, head_bits=head)


def test_parse_bpw_list():
    assert parse_bpw_list("3.0, 4,5.5", "--exl2") == [3.0, 4.0, 5.5]
    with pytest.raises(SpecError, match="--exl2 needs numbers"):
        parse_bpw_list(",", "--exl2")


def test_awq_group_resolution():
    cpu = resolve(AwqSpec(), [576, 1536], cuda=False)
    assert (cpu.group_size, cpu.calib_rows, cpu.calib_length, cpu.clip) == (64, None, 128, False)
    gpu = resolve(AwqSpec(), [2048, 8192], cuda=True)
    assert (gpu.group_size, gpu.calib_rows, gpu.calib_length, gpu.clip) == (128, None, 512, True)
    assert gpu.tag == "awq-w4g128"
    with pytest.raises(SpecError, match=r"AWQ group size 128 does not divide the model's input dims \[576\]"):
        resolve(AwqSpec(group_size=128), [576, 1536], cuda=False)
    with pytest.raises(SpecError, match="neither AWQ group size 128 nor 64"):
        resolve(AwqSpec(), [100], cuda=False)


def test_recipe_unknown_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("awq:\n  w_bit: 4\n  groupsize: 64\nmax_ratio: 2\n")
    with pytest.raises(SpecError) as e:
        recipes.load_recipe(path)
    assert "unknown key 'awq.groupsize'" in e.value.message
    assert "unknown key 'max_ratio'" in e.value.message
    keys = "awq, awqct, exl2, exl3, gguf, calibration, eval, eval_windows, max_ppl_ratio, max_kld, fit"
    assert f"recipe keys: {keys}" in e.value.message


def test_recipe_bad_yaml_and_missing(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("awq: [\n")
    with pytest.raises(SpecError, match="is not valid YAML at line"):
        recipes.load_recipe(path)
    with pytest.raises(SpecError, match="does not exist"):
        recipes.load_recipe(tmp_path / "nope.yaml")


def test_standard_recipe_matches_design():
    recipe = recipes.standard_recipe()
    assert [s.bpw for s in recipe.targets["exl2"].specs()] == [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 8.0]
    assert recipe.targets["awq"] == AwqSpec()
    assert set(recipe.targets) == {"awq", "exl2"}  # EXL3 is asked for, not made by default
    assert (recipe.calibration, recipe.eval, recipe.max_ppl_ratio) == (None, "builtin:wiki", 1.5)


def test_build_recipe_flags_replace_targets(tmp_path):
    only_awq = recipes.build_recipe(awq=True)
    assert set(only_awq.targets) == {"awq"} and only_awq.targets["awq"] == AwqSpec()
    path = tmp_path / "r.yaml"
    path.write_text("exl2: {bpw: [3.0], head_bits: 8}\nawq: {group_size: 64}\nmax_ppl_ratio: 1.2\n")
    r = recipes.build_recipe(path, exl2="4.0,5.0", eval_windows=3)
    assert set(r.targets) == {"exl2"} and [s.tag for s in r.specs()] == ["exl2-4.0bpw-h8", "exl2-5.0bpw-h8"]
    assert (r.max_ppl_ratio, r.eval_windows) == (1.2, 3)
    assert recipes.build_recipe(path, awq=True).targets["awq"].group_size == 64


@pytest.mark.parametrize("method", ["awq", "awqct"])
def test_awq_calibration_rows_fit_a_short_text_unless_asked(method):
    """At 8B on the H200, a 32k-token BPE made builtin:c4 64,601 tokens long: AutoAWQ's 128 x 512 on CUDA failed
    the job at inspect. Unasked, the rows are as many windows as the text holds (at least 16, else the text is
    refused in one sentence); asked for, they stay what the recipe says (and a short text is refused)."""
    from factory import engines

    engine = engines.get(method)
    spec = engine.resolve(engine.spec(), _info([4096, 14336]), "cuda")
    assert spec.calib_rows is None and spec.calib_length == 512
    assert engine.fit_calibration(spec, 1_000_000, "cuda").calib_rows == 128
    assert engine.fit_calibration(spec, 64_601, "cuda").calib_rows == 126
    assert engine.fit_calibration(spec, 5_000, "cuda").calib_rows == 128  # under 16 windows: check_length refuses
    assert engine.fit_calibration(spec.model_copy(update={"calib_rows": 128}), 64_601, "cuda").calib_rows == 128
    cpu = engine.resolve(engine.spec(), _info([4096, 14336]), "cpu")
    assert engine.fit_calibration(cpu, 1_000_000, "cpu").calib_rows == 16


def _info(in_features: list[int]):
    """What an engine's resolve reads of a model: its linear layers' input dims."""
    from types import SimpleNamespace

    return SimpleNamespace(in_features=in_features)


def test_a_gguf_fit_records_the_budget_each_type_was_chosen_for():
    """`--gguf fit --fit 8GB,16GB,12GB`: each type's spec keeps its budget (two budgets that chose one type: the
    smaller); a type asked by name has none; a list of budgets that does not match the types is refused."""
    gib = 2**30
    fits = [{"memory": m * gib, "ctx": 8192, "cache": "fp16"} for m in (8, 16, 12)]
    specs = GgufTargets(types=["Q4_K_M", "Q8_0", "Q4_K_M"], fit=fits).specs()
    assert [(s.type, s.fit.memory // gib) for s in specs] == [("Q8_0", 16), ("Q4_K_M", 8)]
    assert specs[0].model_dump()["fit"] == {"memory": 16 * gib, "ctx": 8192, "cache": "fp16"}
    assert GgufTargets(types=["Q4_K_M"]).specs()[0].fit is None
    with pytest.raises(SpecError, match="gguf fit lists 1 budgets for 2 types; give one per type"):
        GgufTargets(types=["Q4_K_M", "Q8_0"], fit=fits[:1])
