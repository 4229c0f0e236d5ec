"""util.py's one device and process-group setup: every (device, torchrun, GPUs) combination gives an
indexed CUDA device or the CPU; each script takes its device from it; device=cpu never calls into CUDA
on a machine that has GPUs; FSDP shards each block outside its activation-checkpointing recompute."""
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from conftest import FAKE_CUDA, RANKS, TINY_MODEL, run, shared
from model import GPT, GRAD_CKPT, GPTConfig, shard_model
from podgpt.core.util import resolve_device, setup

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
NO_CUDA = "CUDA is not available here"
UNDER_TORCHRUN = "under torchrun: every rank takes its own GPU"
TOO_FEW = "but this machine has"  # and names --nproc_per_node or the devices there are
# (device, LOCAL_RANK or None outside torchrun, GPUs) -> the device, or the error's words
CASES = [
    ("cpu", None, 0, CPU), ("cpu", None, 2, CPU), ("cpu", 1, 2, CPU),
    ("auto", None, 0, CPU), ("auto", 1, 0, CPU), ("auto", None, 1, CUDA0), ("auto", 0, 2, CUDA0),
    ("auto", 1, 2, CUDA1), ("auto", 1, 1, TOO_FEW),
    ("cuda", None, 0, NO_CUDA), ("cuda", 0, 0, NO_CUDA), ("cuda", None, 1, CUDA0), ("cuda", None, 2, CUDA0),
    ("cuda", 1, 2, CUDA1), ("cuda", 2, 2, TOO_FEW),
    ("cuda:1", None, 2, CUDA1), ("cuda:0", None, 1, CUDA0), ("cuda:1", None, 1, TOO_FEW),
    ("cuda:0", None, 0, NO_CUDA), ("cuda:0", 0, 2, UNDER_TORCHRUN),
    ("gpu", None, 1, "is not one of auto, cpu, cuda, cuda:N"), ("cuda:x", None, 1, "is not one of"),
]


@pytest.mark.parametrize("name,local_rank,gpus,want", CASES)
def test_every_device_is_indexed_or_refused(name, local_rank, gpus, want):
    if isinstance(want, torch.device):
        got = resolve_device(name, local_rank, gpus)
        assert got == want and (got.type == "cpu" or got.index is not None)
    else:
        with pytest.raises(ValueError, match=want):
            resolve_device(name, local_rank, gpus)


def fake_gpu_run(args, gpus=1, nproc=1, check=True, env=None):
    """Run a script through tests/fake_cuda.py: as on a machine with `gpus` GPUs that nothing may touch; nproc=2:
    as each of two ranks (RANKS)."""
    assert nproc in (1, 2)
    launch = [sys.executable] if nproc == 1 else RANKS
    return run([*launch, FAKE_CUDA, *args], env=dict(env or {}, PODGPT_FAKE_GPUS=str(gpus)), check=check,
               timeout=300)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, stdlib_data):
    """A 4-step CPU run, checkpointed, made on a machine that has a GPU."""
    def build(out):
        fake_gpu_run(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={out}", *TINY_MODEL, "--max_steps=4",
                      "--micro_batch_size=4", "--total_batch_tokens=256", "--ckpt_every=2", "--eval_every=1000"])
    return shared(tmp_path_factory, "device_cpu_run", build)


def test_device_cpu_makes_no_cuda_call_in_any_script(cpu_run, tmp_path, stdlib_data):
    """train.py (above; fsdp and ddp on 2 ranks in test_fsdp.py), sample.py, export.py, sanity.py and
    the bench probes, with device=cpu on a machine with a GPU: each finishes, so none called into CUDA."""
    r = fake_gpu_run(["sample.py", f"--out_dir={cpu_run}", "--device=cpu", "--prompt=def ", "--max_new_tokens=8"])
    assert r.stdout.startswith("def ") and len(r.stdout.encode()) > len("def \n")  # the prompt, then the sample
    fake_gpu_run(["export.py", f"--out_dir={cpu_run}", f"--out={tmp_path / 'export'}"])
    fake_gpu_run(["sanity.py", "--device=cpu", f"--out_dir={tmp_path / 'sanity'}", f"--data_dir={stdlib_data}",
                  "--block_size=64", "--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--capacity=True"])
    fake_gpu_run(["bench/matmul.py", "--device=cpu", "--sizes=64", "--warmup=1", "--iters=1",
                  f"--out={tmp_path / 'matmul.jsonl'}"])
    fake_gpu_run(["bench/comms.py", "--device=cpu", "--sizes=1024", "--warmup=1", "--iters=1",
                  f"--out={tmp_path / 'comms.jsonl'}"], nproc=2)


def no_allocator_settings(monkeypatch):
    """Neither allocator variable in the scripts' environment (a script run in this process may have set one)."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("script", ["train.py", "sanity.py", "sample.py", "bench/matmul.py"])
def test_every_script_takes_an_indexed_gpu(script, cpu_run, stdlib_data, monkeypatch):
    """device=auto with a GPU present: the first CUDA call each script makes is set_device(cuda:0), the
    one setup's (tests/fake_cuda.py stops it there), with expandable segments already asked of the allocator.
    A bare cuda device is what broke every script on a GPU."""
    no_allocator_settings(monkeypatch)
    args = {"train.py": [f"--data_dir={stdlib_data}", f"--out_dir={cpu_run}_gpu"],
            "sanity.py": [f"--out_dir={cpu_run}_sanity"], "sample.py": [f"--out_dir={cpu_run}"]}.get(script, [])
    r = fake_gpu_run([script, *args, "--device=auto"], check=False)
    said = ("CUDA called: torch.cuda.set_device(cuda:0) with PYTORCH_ALLOC_CONF=expandable_segments:True, "
            "PYTORCH_CUDA_ALLOC_CONF=None")
    assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_users_allocator_settings_are_kept(name, stdlib_data, tmp_path, monkeypatch):
    """A user's own allocator settings reach the first CUDA call as they were, under either name: none is added
    beside the older PYTORCH_CUDA_ALLOC_CONF, which a PYTORCH_ALLOC_CONF would override."""
    no_allocator_settings(monkeypatch)
    mine = {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": None, name: "max_split_size_mb:64"}
    r = fake_gpu_run(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}", "--device=auto"], check=False,
                     env={name: mine[name]})
    said = "CUDA called: torch.cuda.set_device(cuda:0) with " + ", ".join(f"{k}={v}" for k, v in mine.items())
    assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("local_rank,gpus,said", [(0, 2, "CUDA called: torch.cuda.set_device(cuda:0)"),
                                                   (1, 2, "CUDA called: torch.cuda.set_device(cuda:1)"),
                                                   (1, 1, "error: LOCAL_RANK 1 but this machine has 1 GPU: "
                                                          "launch at most --nproc_per_node=1")])
def test_a_torchrun_rank_takes_its_local_gpu(stdlib_data, tmp_path, local_rank, gpus, said):
    """A rank in torchrun's environment (set here: no launcher, whose first failing rank would stop the
    other before it speaks) asks for cuda:LOCAL_RANK, or says the node has too few GPUs."""
    env = dict(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2")
    r = fake_gpu_run(["train.py", f"--data_dir={stdlib_data}", f"--out_dir={tmp_path}", "--device=cuda"], gpus=gpus,
                     check=False, env=env)
    assert r.returncode != 0 and said in r.stderr, r.stderr[-2000:]


@pytest.fixture
def group_of_one():
    """A gloo process group of this process alone, as train.py makes for fsdp without torchrun."""
    proc = setup("cpu", group=True)
    yield proc.dev
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fsdp_shards_each_block_outside_its_recompute(group_of_one, dtype, tol):
    """Checkpoint, then shard: FSDP's hooks on a block (all-gather, input cast) run once per forward, and
    the recompute of grad_ckpt full or selective happens inside, so it sees the inputs the forward saw.
    (torch 2.11-2.12 skip that cast on a recompute that runs the hooks again: bf16 saved, fp32 rebuilt.)
    Checkpointing changes no gradient (fp32: 1e-5; bf16 compute: within its rounding); the RoPE tables
    stay float32 buffers, not block inputs."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 32))
    grads = {}
    for mode in GRAD_CKPT:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                              grad_ckpt=mode))
        shard_model(model, group_of_one, dtype)
        calls = []
        for block in model.layers:
            assert isinstance(block, FSDPModule)
            block.register_forward_pre_hook(lambda module, args: calls.append(module))
        _, loss = model(x, x)
        loss.backward()
        assert len(calls) == len(model.layers), f"grad_ckpt={mode}: the blocks' hooks ran {len(calls)} times"
        assert all(b.rope_cos.dtype == torch.float32 and b.rope_cos.shape == (32, 8) for b in
                   (layer.self_attn for layer in model.layers))
        grads[mode] = [p.grad.full_tensor() for p in model.parameters()]
    for mode in ("full", "selective"):
        for a, b in zip(grads[mode], grads["none"], strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * 1e-2)
