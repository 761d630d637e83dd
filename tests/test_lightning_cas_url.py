"""Lightning with ``ModelCheckpoint(dirpath="cas://...")`` resumes from ``last`` with no cas import
in the training script: fsspec's entry point brings cas in, and cas brings its Lightning fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cas
from tests.prerequisites import require_module

SCRIPT = """
import sys
{first}
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def on_train_start(self):
        print("started at step", self.trainer.global_step)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
checkpoints = ModelCheckpoint(dirpath="cas://runs/lit", every_n_train_steps=2, save_last=True)
trainer = L.Trainer(max_steps=int(sys.argv[1]), callbacks=[checkpoints], logger=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
trainer.fit(Regressor(), loader, ckpt_path="last")
print("finished at step", trainer.global_step)
print("integration loaded:", "cas.training.integrations.lightning" in sys.modules)
"""


def test_lightning_model_checkpoint_on_a_cas_url_resumes_from_last_without_the_integration_import(
    tmp_path: Path,
) -> None:
    require_module("lightning", "pip install 'cas[lightning]'")
    cas.open(tmp_path / "store")
    env = {**os.environ, "CAS_STORE": str(tmp_path / "store")}

    def train(steps: int, first: str) -> str:
        script = tmp_path / "train.py"
        script.write_text(SCRIPT.format(first=first))
        done = subprocess.run([sys.executable, str(script), str(steps)], capture_output=True,
                              text=True, env=env, timeout=300, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    # A script that imports cas before Lightning gets the fix once Lightning is imported...
    first = train(4, "import cas")
    assert "started at step 0" in first and "integration loaded: True" in first
    # ...and one that never imports cas gets it when fsspec opens the first cas:// URL.
    resumed = train(6, "")
    assert "started at step 4" in resumed, "trained from step 0 instead of resuming from last"
    assert "finished at step 6" in resumed and "integration loaded: True" in resumed
