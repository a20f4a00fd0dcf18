import pytest

from factory.engines.exl2.spec import Exl2Spec
from factory.errors import SpecError
from factory.registry import naming


@pytest.mark.parametrize(
    "text, name, tag, rev",
    [
        ("tiny:awq-w4g64", "tiny", "awq-w4g64", None),
        ("SmolLM2-135M-Instruct:EXL2-4.0BPW", "smollm2-135m-instruct", "exl2-4.0bpw", None),
        ("qwen2.5-7b:exl2-6.5bpw-h8@A1B2C3D", "qwen2.5-7b", "exl2-6.5bpw-h8", "a1b2c3d"),
        ("tiny", "tiny", None, None),
        ("tiny@1234567", "tiny", None, "1234567"),
    ],
)
def test_parse_valid(text, name, tag, rev):
    assert naming.parse(text) == naming.QuantRef(name, tag, rev)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("../etc:awq-w4g64", "name '../etc'"),
        ("a..b:awq-w4g64", "no '..'"),
        ("tiny:awq", "tag 'awq'"),
        ("tiny:exl2-4bpw", "tag 'exl2-4bpw'"),
        ("tiny:exl2-4.0bpw-h6", "tag 'exl2-4.0bpw-h6'"),
        ("-x:awq-w4g64", "name '-x'"),
        ("a/b:awq-w4g64", "name 'a/b'"),
        ("tiny:awq-w4g64@xyz", "revision 'xyz'"),
        ("x" * 97, "1-96"),
    ],
)
def test_parse_invalid(text, problem):
    with pytest.raises(SpecError, match="not a valid quant name") as e:
        naming.parse(text)
    assert problem in e.value.message


def test_parse_tag_required():
    with pytest.raises(SpecError, match="a tag is required"):
        naming.parse("tiny", tag_required=True)


@pytest.mark.parametrize(
    "label, name",
    [
        ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("My Model (copy)", "my-model-copy"),
        ("..x..y", "x.y"),
        ("Qwen2.5_7B", "qwen2.5_7b"),
    ],
)
def test_model_name(label, name):
    assert naming.model_name(label) == name


def test_model_name_refuses_nothing_left():
    with pytest.raises(SpecError, match="--name"):
        naming.model_name("!!!")


@pytest.mark.parametrize(
    "bpw, head, tag",
    [(4.0, 6, "exl2-4.0bpw"), (4.31, 8, "exl2-4.31bpw-h8"), (2.5, 6, "exl2-2.5bpw"), (8, 6, "exl2-8.0bpw")],
)
def test_exl2_tag(bpw, head, tag):
    assert Exl2Spec(bpw=bpw, head_bits=head).tag == tag
    assert naming.parse(f"m:{tag}").tag == tag
