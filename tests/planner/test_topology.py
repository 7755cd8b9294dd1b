"""NCCL presets and validation, topology XML, hardware presets and mesh shapes (framework.planner.topology)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from framework.config.schema import HardwareConfig, MeshConfig, NcclConfig
from framework.planner.nccl_variables import NcclDebugVariableWarning
from framework.planner.topology import (
    TopologySummary,
    apply_nccl_environment,
    check_topology,
    describe_nccl,
    nccl_environment,
    nccl_version,
    parse_topology_xml,
    validate_mesh,
    validate_variable,
    write_nccl_record,
)
from tests.dist import run_ranks

CONF = Path(__file__).resolve().parents[2] / "conf"
EXAMPLE_TOPO = CONF / "nccl" / "topo" / "example_h100x8.xml"


def preset(name: str, **overrides: object) -> NcclConfig:
    """A shipped conf/nccl preset merged into the schema, as Hydra merges it."""
    merged = OmegaConf.merge(OmegaConf.structured(NcclConfig), OmegaConf.load(CONF / "nccl" / f"{name}.yaml"))
    merged = OmegaConf.merge(merged, overrides)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, NcclConfig)
    return obj


def env_of(cfg: NcclConfig, run_dir: Path | None = None, procs_per_node: int = 8) -> dict[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NcclDebugVariableWarning)
        return nccl_environment(cfg, run_dir, procs_per_node)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((CONF / "nccl").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_nccl_preset_loads_into_the_schema(path: Path, tmp_path: Path) -> None:
    cfg = preset(path.stem, socket_ifname="eth0")
    assert cfg.preset == path.stem
    env = env_of(cfg, tmp_path)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_default_sets_nothing_but_async_error_handling() -> None:
    assert env_of(preset("default")) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert env_of(preset("default", async_error_handling=1))["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    with pytest.raises(ValueError, match="async_error_handling=5"):
        nccl_environment(preset("default", async_error_handling=5), None, 8)


def test_gdr3_is_phb_and_flags_each_debugging_variable_once() -> None:
    with pytest.warns(NcclDebugVariableWarning) as caught:
        env = nccl_environment(preset("gdr3"), None, 8)
    assert env["NCCL_NET_GDR_LEVEL"] == "PHB" and env["NCCL_NET_GDR_READ"] == "1"
    flagged = sorted(str(w.message).split("=")[0] for w in caught if w.category is NcclDebugVariableWarning)
    assert flagged == ["NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ"]


def test_ib_and_user_env_override() -> None:
    env = env_of(preset("ib"))
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_NET"] == "IB"
    env = env_of(preset("ib", env={"NCCL_NET": "AWS Libfabric", "NCCL_IB_HCA": "=mlx5_0:1"}))
    assert env["NCCL_NET"] == "AWS Libfabric" and env["NCCL_IB_HCA"] == "=mlx5_0:1"


def test_socket_refuses_to_start_without_an_interface() -> None:
    with pytest.raises(ValueError, match="needs nccl.socket_ifname"):
        env_of(preset("socket"))
    env = env_of(preset("socket", socket_ifname="^docker,lo"))
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "^docker,lo"


def test_debug_dumps_the_topology_into_the_run_dir(tmp_path: Path) -> None:
    env = env_of(preset("debug"), tmp_path)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,GRAPH,ENV"
    assert env["NCCL_TOPO_DUMP_FILE"] == str(tmp_path.resolve() / "nccl_topo.xml")
    with pytest.raises(ValueError, match="no run dir"):
        env_of(preset("debug"), None)


def test_field_owned_variables_cannot_come_through_env() -> None:
    with pytest.raises(ValueError, match=r"nccl.env.NCCL_SOCKET_IFNAME .*nccl.socket_ifname"):
        env_of(preset("default", env={"NCCL_SOCKET_IFNAME": "eth0"}))
    with pytest.raises(ValueError, match="nccl.async_error_handling"):
        env_of(preset("default", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}))


# ---------------------------------------------------------------------------------------------
# Validation table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("var", ["NCCL_NET_GDR_LEVEL", "NCCL_P2P_LEVEL"])
@pytest.mark.parametrize(
    "raw, name",
    [
        ("0", "LOC"),
        ("1", "PIX"),
        ("2", "PXB"),
        ("3", "PHB"),
        ("4", "SYS"),
        ("9", "SYS"),
        ("phb", "PHB"),
        ("SYS", "SYS"),
    ],
)
def test_legacy_integer_levels_become_names(var: str, raw: str, name: str) -> None:
    env = env_of(preset("default", env={var: raw}))
    assert env[var] == name


def test_bad_level_names_the_variable_value_and_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"NCCL_NET_GDR_LEVEL='NVL'.*LOC, PIX, PXB, PHB, SYS"):
        env_of(preset("default", env={"NCCL_NET_GDR_LEVEL": "NVL"}))  # NVL is a P2P level only
    assert env_of(preset("default", env={"NCCL_P2P_LEVEL": "NVL"}))["NCCL_P2P_LEVEL"] == "NVL"


@pytest.mark.parametrize(
    "old, replacement",
    [
        ("NCCL_IB_GDR_LEVEL", "NCCL_NET_GDR_LEVEL"),
        ("NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS"),
        ("NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS"),
        ("NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        ("NCCL_CHECK_POINTERS", "NCCL_CHECK_MODE"),
        ("NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"),
    ],
)
def test_removed_variables_are_refused_with_their_replacement(old: str, replacement: str) -> None:
    with pytest.raises(ValueError, match=rf"{old} is removed or deprecated; use .*{replacement}"):
        env_of(preset("default", env={old: "1"}))


def test_launch_mode_group_was_removed() -> None:
    with pytest.raises(ValueError, match="GROUP was removed in NCCL 2.9"):
        validate_variable("NCCL_LAUNCH_MODE", "GROUP")


@pytest.mark.parametrize(
    "var, value",
    [
        ("NCCL_ALGO", "Ring"),
        ("NCCL_ALGO", "^tree"),
        ("NCCL_ALGO", "ring,collnetdirect;allreduce:tree,collnetdirect;broadcast:ring"),
        ("NCCL_ALGO", "allreduce:^tree;allgather:pat"),
        ("NCCL_PROTO", "^LL128"),
        ("NCCL_PROTO", "LL,Simple;allreduce:^LL"),
    ],
)
def test_algo_and_proto_accept_nccl_syntax(var: str, value: str) -> None:
    assert env_of(preset("default", env={var: value}))[var] == value


@pytest.mark.parametrize(
    "var, value, reason",
    [
        ("NCCL_ALGO", "Rings", "Tree, Ring, CollnetDirect"),
        ("NCCL_ALGO", "allreduce:tree;ring", "only the first"),
        ("NCCL_ALGO", "allgathr:ring", "function prefixes"),
        ("NCCL_ALGO", "^", "Tree, Ring"),
        ("NCCL_PROTO", "LL256", "LL, LL128, Simple"),
        ("NCCL_DEBUG", "VERBOSE", "VERSION, WARN, INFO"),
        ("NCCL_DEBUG_SUBSYS", "INIT,GRAPHS", "INIT, COLL"),
        ("NCCL_IB_DISABLE", "yes", "0, 1"),
        ("NCCL_BUFFSIZE", "4M", "integer"),
    ],
)
def test_bad_values_are_refused(var: str, value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=rf"{var}={value!r}.*{reason}".replace("^", r"\^")):
        env_of(preset("default", env={var: value}))


@pytest.mark.parametrize(
    "source, name, message",
    [
        (
            "env",
            "NCCL_SOCKET_IFNAM",
            "nccl.env.NCCL_SOCKET_IFNAM is not an NCCL variable.*did you mean NCCL_SOCKET_IFNAME",
        ),
        ("env", "NCCL_DEBUGG", "did you mean NCCL_DEBUG\\?"),
        (
            "preset_env",
            "TORCH_NCCL_BLOCKING_WAITT",
            "nccl.preset_env.TORCH_NCCL_BLOCKING_WAITT .*TORCH_NCCL_BLOCKING_WAIT",
        ),
        ("env", "LD_PRELOAD", "nccl.env.LD_PRELOAD is refused: only NCCL_\\* / TORCH_NCCL_\\*"),
        ("env", "PATH", "nccl.env.PATH is refused"),
        ("preset_env", "PYTHONPATH", "nccl.preset_env.PYTHONPATH is refused"),
        ("env", "CUDA_DEVICE_MAX_CONNECTIONS", "nccl.env.CUDA_DEVICE_MAX_CONNECTIONS is refused"),
    ],
)
def test_only_known_nccl_names_pass(source: str, name: str, message: str) -> None:
    cfg = preset("default", **{source: {name: "1"}})
    with pytest.raises(ValueError, match=message):
        nccl_environment(cfg, None, 8)


def test_known_names_and_multicast_switches_pass() -> None:
    env = nccl_environment(
        preset("default", env={"NCCL_IB_HCA": "mlx5", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}), None, 8
    )
    assert env["NCCL_IB_HCA"] == "mlx5" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


# ---------------------------------------------------------------------------------------------
# NVLink multicast guard
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "var, on",
    [
        ("NCCL_NVLS_ENABLE", "1"),
        ("NCCL_NVLS_ENABLE", "2"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0"),
        ("NVSHMEM_DISABLE_NVLS", "0"),
    ],
)
def test_multicast_cannot_be_turned_on(var: str, on: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=rf"{var}='{on}' would turn NVLink multicast on"):
        env_of(preset("default", env={var: on}))
    monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    with pytest.raises(ValueError, match="multicast"):
        apply_nccl_environment({"NCCL_DEBUG": "INFO", var: on})
    assert var not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"  # nothing was applied


def test_apply_never_touches_an_existing_multicast_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "true")  # a site's own spelling of "off"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    env = env_of(
        preset("debug", env={"NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}),
        Path("/tmp"),
    )
    with pytest.warns(UserWarning, match="replaces the inherited 'WARN'"):
        apply_nccl_environment(env)
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "true"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["NCCL_DEBUG_SUBSYS"] == "INIT,GRAPH,ENV"


# ---------------------------------------------------------------------------------------------
# Topology XML
# ---------------------------------------------------------------------------------------------


def test_example_topology_parses() -> None:
    s = parse_topology_xml(EXAMPLE_TOPO)
    assert s == TopologySummary(num_gpus=8, num_nics=8, num_net_devices=8, nvlinks_per_gpu=(18,) * 8)
    check_topology(s, 8)


# What NCCL 2.28.9 itself wrote (NCCL_TOPO_DUMP_FILE via the debug preset) on a one-H200 machine:
# the NIC sits straight under the CPU (a virtio NIC), numaid is -1, and an extra host_hash appears.
REAL_DUMP = """\
<system version="1">
  <cpu host_hash="0x140139fddf3f580" numaid="-1" arch="x86_64" vendor="GenuineIntel" familyid="6" modelid="207">
    <pci busid="0000:00:06.0" class="0x030200" vendor="0x10de" device="0x2335" subsystem_vendor="0x10de" subsystem_device="0x18bf" link_speed="32.0 GT/s PCIe" link_width="0">
      <gpu dev="0" sm="90" rank="0" gdr="1"/>
    </pci>
    <nic>
      <net name="eth0" dev="0" latency="0" speed="10000" port="0" guid="0x0" maxconn="65536" gdr="0"/>
    </nic>
  </cpu>
</system>
"""


def test_a_real_nccl_dump_parses(tmp_path: Path) -> None:
    path = tmp_path / "nccl_topo.xml"
    path.write_text(REAL_DUMP)
    s = parse_topology_xml(path)
    assert s == TopologySummary(num_gpus=1, num_nics=1, num_net_devices=1, nvlinks_per_gpu=(0,))
    check_topology(s, 1)


def test_topology_gpu_count_must_match_processes_per_node() -> None:
    with pytest.raises(ValueError, match="describes 8 GPUs but the mesh runs 4 processes per node"):
        check_topology(parse_topology_xml(EXAMPLE_TOPO), 4)
    env = env_of(preset("default", topo_file=str(EXAMPLE_TOPO)), procs_per_node=8)
    assert env["NCCL_TOPO_FILE"] == str(EXAMPLE_TOPO.resolve())
    with pytest.raises(ValueError, match="describes 8 GPUs"):
        env_of(preset("default", topo_file=str(EXAMPLE_TOPO)), procs_per_node=2)


@pytest.mark.parametrize(
    "text, problem",
    [
        ('<system version="1"><cpu numaid="0"><gpu dev="0"></cpu></system>', "malformed XML"),
        ('<topology><gpu dev="0"/></topology>', "root element is <topology>, expected <system>"),
        ('<system version="1"><pci><gpu sm="90"/></pci></system>', "<gpu> has no 'dev'"),
        (
            '<system version="1"><gpu dev="0"><nvlink target="x" count="many"/></gpu></system>',
            "not an integer",
        ),
    ],
)
def test_bad_topology_files_name_the_file_and_problem(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "topo.xml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path}.*{problem}"):
        parse_topology_xml(path)
    with pytest.raises(ValueError, match="not found"):
        parse_topology_xml(tmp_path / "missing.xml")


# ---------------------------------------------------------------------------------------------
# Record for the run dir
# ---------------------------------------------------------------------------------------------


def test_describe_and_record(tmp_path: Path) -> None:
    env = env_of(preset("gdr3"))
    text = describe_nccl(env)
    assert "NCCL_NET_GDR_LEVEL=PHB  [debugging]" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in text
    assert "nothing set" in describe_nccl({})
    record = json.loads(write_nccl_record(tmp_path, env).read_text())
    assert record["env"] == env
    assert record["debugging_variables"] == ["NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ"]
    if torch.cuda.is_available():
        assert record["nccl_version"] and record["nccl_version"].count(".") >= 2
    else:
        assert record["nccl_version"] is None and nccl_version() is None


def _env_on_rank(rank: int, world: int, cfg: NcclConfig, run_dir: Path) -> list[dict[str, str]]:
    env = env_of(cfg, run_dir, procs_per_node=world)
    gathered: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, env)
    return gathered


def test_every_rank_computes_the_same_environment(tmp_path: Path) -> None:
    cfg = preset("debug", env={"NCCL_ALGO": "allreduce:tree"})
    results = run_ranks(_env_on_rank, 2, cfg, tmp_path)
    assert all(r == results[0] for r in results)
    assert results[0][0] == results[0][1] and results[0][0]["NCCL_ALGO"] == "allreduce:tree"


# ---------------------------------------------------------------------------------------------
# Hardware presets and mesh shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, memory_gib, tflops, nvlink, net",
    [
        ("h100_sxm", 79.6, 989.0, 450.0, 50.0),
        ("h200", 140.4, 989.0, 450.0, 50.0),
        ("a100_80gb", 80.0, 312.0, 300.0, 25.0),
    ],
)
def test_hardware_presets_carry_published_figures(
    name: str, memory_gib: float, tflops: float, nvlink: float, net: float
) -> None:
    raw = OmegaConf.load(CONF / "mesh" / "hardware" / f"{name}.yaml")
    hw = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareConfig), raw))
    assert isinstance(hw, HardwareConfig) and hw.name == name
    assert (hw.memory_gib, hw.peak_tflops, hw.intra_node_gbps, hw.inter_node_gbps) == (
        memory_gib,
        tflops,
        nvlink,
        net,
    )
    assert 1.0 <= hw.intra_node_latency_us <= hw.inter_node_latency_us <= 10.0
    assert (CONF / "mesh" / "hardware" / "cpu.yaml").is_file()


@pytest.mark.parametrize(
    "name, world, nodes, ppn",
    [
        ("1", 1, 1, 1),
        ("2", 2, 1, 2),
        ("4", 4, 1, 4),
        ("8", 8, 1, 8),
        ("2x2", 4, 2, 2),
        ("2x4", 8, 2, 4),
        ("4x2", 8, 4, 2),
        ("2x2x2", 8, 2, 4),
        ("16x8", 128, 16, 8),
        ("128x8", 1024, 128, 8),
    ],
)
def test_mesh_shapes_exist_and_validate(name: str, world: int, nodes: int, ppn: int) -> None:
    raw = OmegaConf.load(CONF / "mesh" / f"{name}.yaml")
    mesh = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MeshConfig), raw))
    assert isinstance(mesh, MeshConfig)
    validate_mesh(mesh)
    assert (mesh.world_size, mesh.nodes, mesh.procs_per_node) == (world, nodes, ppn)


@pytest.mark.parametrize(
    "shape, bad", [([], "empty"), ([2, 0], "entry 0"), ([-4], "entry -4"), ([2, True], "True")]
)
def test_bad_mesh_shapes_are_refused(shape: list, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        validate_mesh(MeshConfig(shape=shape))


def test_presets_compose_through_hydra(tmp_path: Path) -> None:
    """The whole primary config with these groups chosen, as the trainer composes it."""
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.config.schema import quote_numeric_choices, to_config
    from framework.launch import recipes

    config.register()
    recipes.register()
    overrides = ["nccl=socket", "nccl.socket_ifname=eth0", "mesh=2x2x2", "mesh/hardware=h200"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_config(compose("config", overrides=quote_numeric_choices(overrides)))
    validate_mesh(cfg.mesh)
    assert cfg.mesh.hardware.name == "h200" and cfg.mesh.procs_per_node == 4
    env = env_of(cfg.nccl, tmp_path, cfg.mesh.procs_per_node)
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_DISABLE"] == "1"
    # From the command line, as from a recipe: only known NCCL names reach the ranks.
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_config(compose("config", overrides=["+nccl.env.LD_PRELOAD=/tmp/evil.so"]))
    with pytest.raises(ValueError, match=r"^nccl\.env\.LD_PRELOAD is refused: only NCCL_\* / TORCH_NCCL_\*"):
        nccl_environment(cfg.nccl, tmp_path, cfg.mesh.procs_per_node)
