"""Per-layer energy models over residual-stream states (the core of Energy Landscape Steering)."""

from aligntax.energy.bank import EnergyBank, train_layers
from aligntax.energy.model import EnergyConfig, EnergyModel
from aligntax.energy.plots import plot_energy_histograms
from aligntax.energy.train import (
    EnergyTrainer,
    TrainResult,
    auroc,
    best_threshold,
    sign_metrics,
    state_labels,
)

__all__ = [
    "EnergyBank",
    "EnergyConfig",
    "EnergyModel",
    "EnergyTrainer",
    "TrainResult",
    "auroc",
    "best_threshold",
    "plot_energy_histograms",
    "sign_metrics",
    "state_labels",
    "train_layers",
]
