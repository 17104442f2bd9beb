"""torchao low-bit AdamW on real FSDP2 (DTensor) and FSDP1 (flat shards), 2 gloo CPU ranks.

    torchrun --nproc_per_node 2 scripts/torchao_fsdp_facts.py AdamW8bit   # one class per process

Writes /tmp/ao_fsdp_<class>_rank<N>.json: the state type per parameter, ledger bytes, or the crash.
"""

import json
import logging
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

warnings.filterwarnings("ignore")
logging.getLogger("torchao").setLevel(logging.ERROR)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import torchao.optim as ao  # noqa: E402

from effitrain.memory.ledger import optimizer_state_ledger  # noqa: E402


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 4))


def run(model, cls):
    opt = getattr(ao, cls)(model.parameters(), lr=1e-3)
    for _ in range(2):
        torch.manual_seed(1)
        model(torch.randn(8, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    kinds = []
    for p in model.parameters():
        if "exp_avg" not in opt.state[p]:
            kinds.append("no state (empty local shard)")
            continue
        v = opt.state[p]["exp_avg"]
        local = v.to_local() if hasattr(v, "to_local") else v
        kinds.append(f"{type(v).__name__}/{type(local).__name__}{tuple(local.shape)}")
    cs = sum(
        float((p.to_local() if hasattr(p, "to_local") else p).detach().double().sum())
        for p in model.parameters()
    )
    return {"kinds": kinds, "ledger_bytes": optimizer_state_ledger(opt).bytes, "checksum": cs}


dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
facts = {"rank": rank, "fsdp2": {}, "fsdp1": {}}
for cls in sys.argv[1:]:
    for kind in ("fsdp2", "fsdp1"):
        try:
            if kind == "fsdp2":
                m = make_model()
                fully_shard(m, mesh=mesh)
            else:
                m = FullyShardedDataParallel(
                    make_model(), device_id=torch.device("cpu"), use_orig_params=True
                )
            facts[kind][cls] = run(m, cls)
        except Exception as e:
            facts[kind][cls] = f"crash: {type(e).__name__}: {str(e)[:300]}"
with open(f"/tmp/ao_fsdp_{sys.argv[1]}_rank{rank}.json", "w") as handle:
    json.dump(facts, handle, indent=1)
dist.destroy_process_group()
