"""Security of the remote vLLM path (issue 11 §6): the loopback guard, private sync files, the API-key warning.

No server is started: the launcher's guard is checked against vLLM's own argument parser (in a
subprocess, ~15 s to import vLLM) and stops before ``subprocess.Popen``; the sync files are
written through the engine's real sync path with the two HTTP calls replaced.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_offpolicy.rollout.vllm import RemoteVLLMEngine, launch_local_server
from lightning_offpolicy.rollout.vllm import server as vllm_server
from lightning_offpolicy.rollout.vllm.settings import ConnectionSettings, RemoteWeightSyncSettings
from lightning_offpolicy.rollout.vllm.sync.export import write_safetensors
from tests.vllm_fixtures import requires_vllm

#: Spellings of --host / --port / --logprobs-mode that vLLM's parser accepts (abbreviations, =, underscores).
SPELLINGS = [
    ["--hos", "0.0.0.0"],
    ["--ho=::"],
    ["--host", "10.0.0.5"],
    ["--por", "81"],
    ["--logprobs_mode", "raw_logprobs"],
    ["--logprobs-m=raw_logits"],
]


class _Launched(Exception):
    """Raised instead of starting the server: carries the command line."""


@pytest.fixture
def no_launch(monkeypatch):
    def popen(cmd, **kwargs):
        raise _Launched(cmd)

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)


@requires_vllm
def test_the_guard_reads_extra_args_as_vllms_parser_does():
    code = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "out = []\n"
        "for a in json.loads(sys.argv[1]):\n"
        "    ns = p.parse_args(['--model', 'x', '--host', '127.0.0.1', '--port', '1', *a])\n"
        "    out.append([ns.host, ns.port, ns.logprobs_mode])\n"
        "print('RESULT' + json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(SPELLINGS)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    vllm_reads = json.loads(run.stdout.split("RESULT", 1)[1])
    for args, (host, port, mode) in zip(SPELLINGS, vllm_reads, strict=True):
        ours = {
            flag: [value for _, value in vllm_server._option_values(args, flag)]
            for flag in ("--host", "--port", "--logprobs-mode")
        }
        assert ours["--host"][-1:] == ([] if host == "127.0.0.1" else [host]), args
        assert ours["--port"][-1:] == ([] if port == 1 else [str(port)]), args
        assert ours["--logprobs-mode"][-1:] == (
            [] if mode == "raw_logprobs" and not ours["--logprobs-mode"] else [mode]
        )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--hos", "0.0.0.0"], r"--host 0.0.0.0 \(as '--hos'.*not a loopback address.*allow_non_loopback=True"),
        (["--ho=::"], r"--host :: \(as '--ho=::'"),
        (["--host", "10.0.0.5"], "not a loopback address"),
        (["--host", "trainer.example.com"], "not a loopback address"),  # a name may resolve to anything
        (["--por", "81"], r"must not set --port \(here as '--por'"),
        (["--config", "serve.yaml"], "must not set --config"),
        (["--logprobs_mode", "raw_logprobs"], "processed_logprobs"),
        (["--logprobs-m=raw_logits"], "processed_logprobs"),
    ],
)
def test_launcher_refuses_a_non_loopback_bind_in_any_spelling(tmp_path, no_launch, extra, match):
    with pytest.raises(ValueError, match=match):
        launch_local_server(tmp_path, extra_args=extra)


def test_launcher_passes_loopback_and_explicitly_allowed_binds(tmp_path, no_launch):
    for extra, allow, reach in [
        (["--host", "::1"], False, "::1"),
        (["--hos=localhost"], False, "localhost"),
        (["--hos", "0.0.0.0"], True, "127.0.0.1"),
    ]:
        with pytest.raises(_Launched) as launched:
            launch_local_server(tmp_path, extra_args=extra, allow_non_loopback=allow)
        cmd = launched.value.args[0]
        assert cmd[-len(extra) :] == extra  # after the launcher's own --host 127.0.0.1: the last one wins
        assert vllm_server._connect_host(vllm_server._option_values(extra, "--host")[-1][1]) == reach
    with pytest.raises(ValueError, match="allow_non_loopback"):
        launch_local_server(tmp_path, allow_non_loopback="yes")


@pytest.fixture
def umask_000():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(("share", "dir_mode", "file_mode"), [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_sync_directory_and_file_are_private_under_umask_000(
    tmp_path, umask_000, monkeypatch, share, dir_mode, file_mode
):
    engine = RemoteVLLMEngine(
        "http://127.0.0.1:9",
        weight_sync=RemoteWeightSyncSettings(weights_dir=str(tmp_path / "weights"), share_with_group=share),
    )
    monkeypatch.setattr(engine, "_has_receiver", lambda: False)  # the three HTTP calls of a sync
    monkeypatch.setattr(engine, "_reload_weights", lambda path: None)
    monkeypatch.setattr(engine, "_reset_prefix_cache", lambda: None)
    engine._sync({"w": torch.ones(3)})
    sync_dir = engine._sync_dir
    files = list(sync_dir.iterdir())
    assert [f.name for f in files] == ["model.safetensors"]
    # Before: 0777 / 0666 under umask 000, so any local user could swap the weights before the reload.
    assert (_mode(tmp_path / "weights"), _mode(sync_dir), _mode(files[0])) == (dir_mode, dir_mode, file_mode)
    engine.close()


def test_write_safetensors_ignores_the_umask_and_leftovers(tmp_path, umask_000):
    (tmp_path / "model.safetensors.partial").write_bytes(b"crash leftover")
    os.chmod(tmp_path / "model.safetensors.partial", 0o666)
    path = write_safetensors({"w": torch.arange(4.0)}, tmp_path)
    assert _mode(path) == 0o600 and not (tmp_path / "model.safetensors.partial").exists()
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(path))["w"], torch.arange(4.0))
    assert _mode(write_safetensors({"w": torch.ones(1)}, tmp_path / "new")) == 0o600
    assert _mode(tmp_path / "new") == 0o700


@pytest.mark.parametrize(("share", "dir_mode"), [(False, 0o700), (True, 0o750)])
def test_missing_parents_of_weights_dir_are_created_private_under_umask_000(tmp_path, umask_000, share, dir_mode):
    before = _mode(tmp_path)
    weights = tmp_path / "jobs" / "run1" / "weights"
    engine = RemoteVLLMEngine(
        "http://127.0.0.1:9", weight_sync=RemoteWeightSyncSettings(weights_dir=str(weights), share_with_group=share)
    )
    sync_dir = engine._ensure_sync_dir()
    # Before: `mkdir -p` made jobs/ and run1/ 0777 under umask 000, so any local user could rename weights/ away
    # and put a directory of their own in its place before the server reloads from it.
    created = [tmp_path / "jobs", tmp_path / "jobs" / "run1", weights, sync_dir]
    assert [oct(_mode(d)) for d in created] == [oct(dir_mode)] * 4
    assert _mode(tmp_path) == before  # an existing directory is left as it is
    engine.close()
    path = write_safetensors({"w": torch.ones(1)}, tmp_path / "direct" / "sync")
    assert [_mode(d) for d in (tmp_path / "direct", path.parent, path)] == [0o700, 0o700, 0o600]


def test_world_writable_weights_dir_without_sticky_bit_warns(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    engine = RemoteVLLMEngine("http://127.0.0.1:9", weight_sync=RemoteWeightSyncSettings(weights_dir=str(root)))
    with pytest.warns(RuntimeWarning, match="writable by other users .*sticky bit"):
        engine._ensure_sync_dir()
    engine.close()
    os.chmod(root, 0o1777)  # like /tmp: others cannot rename our entries
    engine = RemoteVLLMEngine("http://127.0.0.1:9", weight_sync=RemoteWeightSyncSettings(weights_dir=str(root)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine._ensure_sync_dir()
    engine.close()


def test_api_key_over_plain_http_to_another_host_warns(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.warns(RuntimeWarning, match=r"API key goes to 10.0.0.5 over plain http://"):
        RemoteVLLMEngine("http://10.0.0.5:8000", connection=ConnectionSettings(api_key="secret"))
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    with pytest.warns(RuntimeWarning, match="over plain http://"):
        RemoteVLLMEngine("http://rollout-node:8000")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RemoteVLLMEngine("https://10.0.0.5:8000")  # TLS
        RemoteVLLMEngine("http://127.0.0.1:8000")  # loopback
        RemoteVLLMEngine("http://[::1]:8000")
        monkeypatch.delenv("VLLM_API_KEY")
        RemoteVLLMEngine("http://10.0.0.5:8000")  # no key to leak
