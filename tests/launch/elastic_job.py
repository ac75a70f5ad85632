"""A program for tests/launch/test_elastic.py: `tpudist.fit` with checkpoints, on hosts that may vanish.

    python elastic_job.py CHECKPOINT_DIR STALL_AT OUT

Trains a small model (no dropout: the same numbers whatever the process count) with SGD and
momentum on a shuffled loader for 3 epochs, checkpointing every step. On the first attempt rank 1
stops when it fetches loader batch STALL_AT (it writes OUT.stalled and sleeps), so that the test
can take its host away; 0 never stalls. Rank 0 writes the final parameters and the history to OUT
(a torch file).
"""

import os, sys, time
import torch, torch.nn.functional as F
from torch import nn
import tpudist



def data():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g))


def model_and_optimizer(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loader():
    return torch.utils.data.DataLoader(data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


class Stalling:
    """The loader, except that rank 1 of the first attempt stops at batch `at` (and says so)."""

    def __init__(self, loader, at, out):
        self.loader, self.at, self.out, self.generator = loader, at, out, loader.generator

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader, 1):
            if i == self.at and os.environ.get("TPUDIST_RESTART") == "0" and tpudist.process_index() == 1:
                open(self.out + ".stalled", "w").close()
                time.sleep(600)
            yield batch


if __name__ == "__main__":
    tpudist.init()
    directory, stall_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model, opt = model_and_optimizer()
    history = tpudist.fit(model, Stalling(loader(), stall_at, out), opt, F.cross_entropy, epochs=3,
                          checkpoint_dir=directory, checkpoint_every=1, log=True)
    if tpudist.process_index() == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in model.named_parameters()},
                    "history": history, "processes": tpudist.process_count()}, out)
        print("final", tpudist.process_count(), flush=True)
