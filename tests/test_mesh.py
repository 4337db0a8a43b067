import jax
import pytest

from jaxdist.distributed import mesh
from jaxdist.errors import JaxdistError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dp=4,fsdp=2", {"dp": 4, "pp": 1, "fsdp": 2, "cp": 1, "ep": 1, "tp": 1}),
        ("fsdp=2,dp=4", {"dp": 4, "pp": 1, "fsdp": 2, "cp": 1, "ep": 1, "tp": 1}),
        ("tp=2,fsdp=-1", {"dp": 1, "pp": 1, "fsdp": 4, "cp": 1, "ep": 1, "tp": 2}),
        ("ep=4,fsdp=-1", {"dp": 1, "pp": 1, "fsdp": 2, "cp": 1, "ep": 4, "tp": 1}),
        ("cp=4,fsdp=-1", {"dp": 1, "pp": 1, "fsdp": 2, "cp": 4, "ep": 1, "tp": 1}),
        ("", None),
    ],
)
def test_parse(text, expected):
    if expected is None:
        with pytest.raises(JaxdistError, match="needs 1 devices but there are 8"):
            mesh.parse_mesh(text, 8)
    else:
        assert mesh.parse_mesh(text, 8) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("dp=4,fsdp=8", "needs 32 devices but there are 8"),
        ("dp=2,xp=4", "unknown mesh axis 'xp'"),
        ("dp=-1,fsdp=-1", "only one mesh axis may be -1"),
        ("dp=0,fsdp=8", "must be positive"),
        ("dp=-2,fsdp=4", "must be positive"),
        ("dp=x", "needs an integer size"),
        ("dp=3,fsdp=-1", "not divisible"),
        ("dp=2,dp=4", "given twice"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(JaxdistError, match=message) as err:
        mesh.parse_mesh(text, 8)
    assert "\n" not in str(err.value)


def test_mesh_is_auto_and_keeps_tp_innermost():
    m = mesh.mesh_from_string("dp=2,fsdp=2,tp=2")
    assert m.axis_names == ("dp", "pp", "fsdp", "cp", "ep", "tp")
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    ids = [[d.id for d in row] for row in m.devices.reshape(-1, 2)]
    assert all(b - a == 1 for a, b in ids)  # tp pairs are neighbouring devices


def test_default_dcn_puts_hosts_on_dp_first():
    assert mesh.default_dcn({"dp": 2, "pp": 1, "fsdp": 4, "cp": 1, "tp": 1}, 2)["dp"] == 2
    assert mesh.default_dcn({"dp": 1, "pp": 1, "fsdp": 8, "cp": 1, "tp": 1}, 2)["fsdp"] == 2
