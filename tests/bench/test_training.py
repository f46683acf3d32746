"""The training benchmark's step is the trainer's step (it may not import the trainer)."""

import torch

from lapse.bench.training import optimizer_step
from lapse.models import Decoder, optimizer_groups, preset
from lapse.train.trainer import train_step


def test_the_benchmark_step_is_the_trainer_step():
    cfg = preset("tiny", "fox-pro", acp=True, vocab_size=128, max_seq_len=32)
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    results = []
    for step in (optimizer_step, train_step):
        torch.manual_seed(0)
        model = Decoder(cfg)
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        if step is optimizer_step:
            loss = step(model, opt, x, y, 2)
        else:
            loss, _ = step(model, opt, x, y, 2, torch.device("cpu"), torch.bfloat16, 1.0)
        results.append((loss, model.state_dict()))
    (la, wa), (lb, wb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
