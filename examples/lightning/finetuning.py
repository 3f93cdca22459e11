"""Lightning's transfer-learning example (examples/pytorch/domain_templates/computer_vision_fine_tuning.py) on
synthetic images, ported by docs/lightning.md's rename table alone.

    python examples/lightning/finetuning.py fit --trainer.max_epochs 3 --finetuning.milestones '[1,2]'

Training runs in three stages, as in Lightning's example. Up to the first milestone the feature extractor (the
"pre-trained" network) is frozen and only the classifier learns, at lr = 1e-3. At the first milestone the last five
layer groups of the extractor are unfrozen and added to the optimizer as a new parameter group (at a tenth of the
current learning rate, which the scheduler has just divided by 10); at the second milestone the remaining groups
join as a third parameter group. BatchNorm layers stay frozen unless ``--finetuning.train_bn true``.

In place of a pre-trained ResNet50 and the cats-and-dogs images: a ResNet-shaped network at 16 x 16 pixels (stem,
four stages, pooling; 8 to 32 channels) and images whose class adds a faint pattern to noise. The data are read in
order (not shuffled), so that every framework sees the same batches (docs/lightning.md says why), and the step
logs ``train_loss`` beside Lightning's ``train_acc``, to compare runs by.

Adapted from PyTorch Lightning's example (Copyright The Lightning AI team, Apache License 2.0).
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import MultiStepLR
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Accuracy

from trainkit import DataModule, TrainModule
from trainkit.callbacks import BaseFinetuning
from trainkit.cli import TrainkitCLI
from trainkit.utilities import rank_zero_info

log = logging.getLogger(__name__)


def stage(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class TinyResNet(nn.Module):
    """A ResNet's children in a ResNet's order (conv1, bn1, relu, maxpool, layer1-4, avgpool, fc), small."""

    def __init__(self, width: int = 8, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = stage(width, width, 1)
        self.layer2 = stage(width, 2 * width, 2)
        self.layer3 = stage(2 * width, 2 * width, 2)
        self.layer4 = stage(2 * width, 4 * width, 1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


BACKBONES = {"tiny_resnet": TinyResNet}


def synthetic_cats_and_dogs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g) + labels.view(-1, 1, 1, 1)
    return TensorDataset(images, labels)


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module: TrainModule):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module: TrainModule, epoch: int, optimizer: Optimizer):
        if epoch == self.milestones[0]:
            # unfreeze 5 last layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[-5:], optimizer=optimizer, train_bn=self.train_bn
            )

        elif epoch == self.milestones[1]:
            # unfreeze remaining layers
            self.unfreeze_and_add_param_group(
                modules=pl_module.feature_extractor[:-5], optimizer=optimizer, train_bn=self.train_bn
            )


class CatDogImageDataModule(DataModule):
    def __init__(self, num_workers: int = 0, batch_size: int = 8):
        """Synthetic cats and dogs: 384 training and 64 validation images of 3 x 16 x 16.

        Args:
            num_workers: number of CPU workers
            batch_size: number of sample in a batch

        """
        super().__init__()

        self._num_workers = num_workers
        self._batch_size = batch_size

    def __dataloader(self, train: bool):
        """Train/validation loaders."""
        dataset = synthetic_cats_and_dogs(384, seed=1) if train else synthetic_cats_and_dogs(64, seed=2)
        return DataLoader(dataset=dataset, batch_size=self._batch_size, num_workers=self._num_workers)

    def train_dataloader(self):
        log.info("Training data loaded.")
        return self.__dataloader(train=True)

    def val_dataloader(self):
        log.info("Validation data loaded.")
        return self.__dataloader(train=False)


class TransferLearningModel(TrainModule):
    def __init__(
        self,
        backbone: str = "tiny_resnet",
        train_bn: bool = False,
        milestones: tuple = (2, 4),
        batch_size: int = 32,
        lr: float = 1e-3,
        lr_scheduler_gamma: float = 1e-1,
        num_workers: int = 6,
        **kwargs,
    ) -> None:
        """TransferLearningModel.

        Args:
            backbone: Name (a key of ``BACKBONES``) of the feature extractor
            train_bn: Whether the BatchNorm layers should be trainable
            milestones: List of two epochs milestones
            lr: Initial learning rate
            lr_scheduler_gamma: Factor by which the learning rate is reduced at each milestone

        """
        super().__init__()
        self.backbone = backbone
        self.train_bn = train_bn
        self.milestones = milestones
        self.batch_size = batch_size
        self.lr = lr
        self.lr_scheduler_gamma = lr_scheduler_gamma
        self.num_workers = num_workers

        self.__build_model()

        self.train_acc = Accuracy(task="binary")
        self.valid_acc = Accuracy(task="binary")
        self.save_hyperparameters()

    def __build_model(self):
        """Define model layers & loss."""
        # 1. The "pre-trained" network:
        backbone = BACKBONES[self.backbone]()

        _layers = list(backbone.children())[:-1]
        self.feature_extractor = nn.Sequential(*_layers)

        # 2. Classifier:
        _fc_layers = [nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 1)]
        self.fc = nn.Sequential(*_fc_layers)

        # 3. Loss:
        self.loss_func = F.binary_cross_entropy_with_logits

    def forward(self, x):
        """Forward pass.

        Returns logits.

        """
        # 1. Feature extraction:
        x = self.feature_extractor(x)
        x = x.squeeze(-1).squeeze(-1)

        # 2. Classifier (returns logits):
        return self.fc(x)

    def loss(self, logits, labels):
        return self.loss_func(input=logits, target=labels)

    def training_step(self, batch, batch_idx):
        # 1. Forward pass:
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)

        # 2. Compute loss
        train_loss = self.loss(y_logits, y_true)
        self.log("train_loss", train_loss)

        # 3. Compute accuracy:
        self.log("train_acc", self.train_acc(y_scores, y_true.int()), prog_bar=True)

        return train_loss

    def validation_step(self, batch, batch_idx):
        # 1. Forward pass:
        x, y = batch
        y_logits = self.forward(x)
        y_scores = torch.sigmoid(y_logits)
        y_true = y.view((-1, 1)).type_as(x)

        # 2. Compute loss
        self.log("val_loss", self.loss(y_logits, y_true), prog_bar=True)

        # 3. Compute accuracy:
        self.log("val_acc", self.valid_acc(y_scores, y_true.int()), prog_bar=True)

    def configure_optimizers(self):
        parameters = list(self.parameters())
        trainable_parameters = list(filter(lambda p: p.requires_grad, parameters))
        rank_zero_info(
            f"The model will start training with only {len(trainable_parameters)} "
            f"trainable parameters out of {len(parameters)}."
        )
        optimizer = optim.Adam(trainable_parameters, lr=self.lr)
        scheduler = MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_scheduler_gamma)
        return [optimizer], [scheduler]


class MyCLI(TrainkitCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
        parser.link_arguments("data.batch_size", "model.batch_size")
        parser.link_arguments("finetuning.milestones", "model.milestones")
        parser.link_arguments("finetuning.train_bn", "model.train_bn")
        parser.set_defaults(
            {
                "trainer.max_epochs": 15,
                "trainer.enable_model_summary": False,
                "trainer.num_sanity_val_steps": 0,
            }
        )


def cli_main():
    MyCLI(TransferLearningModel, CatDogImageDataModule, seed_everything_default=1234)


if __name__ == "__main__":
    cli_main()
