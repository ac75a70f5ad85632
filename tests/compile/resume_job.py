"""A program for tests/compile/test_resume.py: `tpudist.fit` with checkpoints, through the launcher.

    python resume_job.py CHECKPOINT_DIR KILL_AT OUT EPOCHS

Trains a small model with dropout, AdamW and a StepLR schedule on a shuffled loader, checkpointing
every 4 steps; with KILL_AT > 0, rank 1 of the first attempt is SIGKILLed when it fetches that
batch. Rank 0 writes a hash of the final model and optimizer state to OUT.
"""

import hashlib, os, signal, sys
import torch, torch.nn.functional as F
from torch import nn
import tpudist

tpudist.init()
directory, kill_at, out, epochs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 3))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


class Crashing:
    """The loader, except that on the first attempt rank 1 is killed (SIGKILL) when it fetches batch `at`."""

    def __init__(self, loader, at):
        self.loader, self.at, self.generator = loader, at, loader.generator
        self.fetched = 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.fetched += 1
            if self.fetched == self.at and os.environ.get("TPUDIST_RESTART") == "0" and tpudist.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch


# RESUME_SHARDING=fsdp: the same run with every parameter and its moments split over the processes
sharded = {"mesh": tpudist.mesh.make_mesh({"fsdp": -1}), "sharding": tpudist.Sharding(fsdp=True, min_bytes=0)} \
    if os.environ.get("RESUME_SHARDING") == "fsdp" else {}
history = tpudist.fit(model, Crashing(loader, kill_at), opt, F.cross_entropy, epochs=epochs, lr_scheduler=schedule,
                      checkpoint_dir=directory, checkpoint_every=4, log=True, **sharded)
if tpudist.process_index() == 0:
    digest = hashlib.sha256()
    for value in list(model.state_dict().values()) + [t for s in opt.state_dict()["state"].values() for t in s.values()]:
        digest.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    with open(out, "w") as f:
        f.write(f"{digest.hexdigest()} {opt.param_groups[0]['lr']!r}\n")
    print("final", digest.hexdigest(), opt.param_groups[0]["lr"], flush=True)
