"""Training EAGLE-3 drafters: regenerated data, draft vocabulary, TTT loss, trainer."""

from eagle3jax.training.data import (DataPosition, FeatureCache, TargetFeatures, TrainingData,
                                     build_training_data, feature_cache_bytes, pack,
                                     regenerate, target_features)
from eagle3jax.training.misses import Bin, MissBreakdown, miss_breakdown
from eagle3jax.training.trainer import (TRAINABLE, TrainConfig, Trainer, TrainResult,
                                        make_optimizer, train_drafter)
from eagle3jax.training.ttt import (drafter_layer, label_distribution, loss_start,
                                    soft_cross_entropy, ttt_attention_mask, ttt_loss,
                                    ttt_step_layer)
from eagle3jax.training.vocab import DraftVocab, build_draft_vocab

__all__ = [
    "DataPosition", "FeatureCache", "feature_cache_bytes",
    "TargetFeatures", "TrainingData", "build_training_data", "pack", "regenerate",
    "target_features", "Bin", "MissBreakdown", "miss_breakdown", "TRAINABLE", "TrainConfig",
    "Trainer", "TrainResult", "make_optimizer",
    "train_drafter", "drafter_layer", "label_distribution", "loss_start", "soft_cross_entropy",
    "ttt_attention_mask", "ttt_loss", "ttt_step_layer", "DraftVocab", "build_draft_vocab",
]
