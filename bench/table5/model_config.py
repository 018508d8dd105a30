"""What a Table 5 run is made of: the model's configuration, a row, and what preparation hands every row.

Plain data, shared by training (``train.py``), co-training, the product job's files and the report.
``ModelConfig.digest`` is the pre-trained halves' cache key; ``cut_key`` a co-trained row's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch
from tokenizers import Tokenizer

FINE_TUNING_FIELDS = (
    "adapter",
    "lr",
    "warmup",
    "train_head",
    "train_top",
    "finetune_batch",
    "cut_lr",
    "cut_residual_lr",
)
"""ModelConfig fields pre-training never reads: changing them reuses the cached pre-trained LMs."""


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    length: int = 24
    vocab: int = 4000
    adapter: int = 64
    batch: int = 32
    pretrain_steps: int = 1500
    pretrain_lr: float = 2e-3
    lr: float = 3e-3
    warmup: int = 0
    """Fine-tuning steps of linear lr warm-up (0: none)."""
    train_head: bool = False
    """Also train the decoder's output layer (its final norm and vocabulary head), the rest stays frozen."""
    train_top: int = 0
    """Also train the decoder LM's top ``train_top`` blocks (0: they stay frozen, as in the paper)."""
    finetune_batch: int = 0
    """Sentence pairs per fine-tuning step (0: ``batch``, the pre-training batch). Apart from ``batch`` so a
    larger fine-tuning batch reuses the cached pre-trained LMs (pre-training reads ``batch``)."""
    cut_lr: float = 0.0
    """Learning rate of the learned bottleneck's projections (0: ``lr``, the adapters'); same warm-up."""
    cut_residual_lr: float = 0.0
    """Learning rate of the bottleneck's residual paths (0: ``cut_lr``, as its projections'); same warm-up."""
    translation_steps: int = 0
    """After the LMs' own pre-training, steps of training the whole model (LMs and adapters) on the
    training pairs with codec none (0: none). Fine-tuning then starts from a model that translates: the
    LMs stay frozen, the adapters start from these weights."""
    translation_lr: float = 1e-3
    """Peak Adam learning rate of that training (linear warm-up over 200 steps, or a tenth of them)."""
    translation_batch: int = 128
    """Sentence pairs per step of that training."""

    def __post_init__(self) -> None:
        for name in ("batch", "finetune_batch"):
            value = getattr(self, name)
            least = 1 if name == "batch" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"ModelConfig.{name} must be an integer >= {least}"
                    + (" (0: the pre-training batch)" if name == "finetune_batch" else "")
                    + f", got {value!r}"
                )

    @property
    def tune_batch(self) -> int:
        """The fine-tuning batch in effect: ``finetune_batch``, or ``batch`` when it is 0."""
        return self.finetune_batch or self.batch

    def digest(self, corpus_sha: str) -> str:
        """The pre-trained LMs' cache key: only the fields pre-training reads (fine-tuning ones share it)."""
        fields = {k: v for k, v in asdict(self).items() if k not in FINE_TUNING_FIELDS}
        text = json.dumps({**fields, "corpus": corpus_sha}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Row:
    """One Table 5 row: codec specs per direction, and the learned bottleneck width (0: none)."""

    label: str
    forward: str = "none"
    backward: str = "none"
    cut_k: int = 0
    residual: bool = False
    down_residual: int = 0
    """Hidden width of the down-projection's residual path (0: none; ``DownProjection(residual=...)``)."""
    up_residual: int = 0
    """Hidden width of the up-projection's residual path (0: ``residual``'s default width when it is set)."""
    cut_pretrain: int = 0
    """Steps of training both halves as an autoencoder on calibration activations before fine-tuning."""
    cut_cotrain: int = 0
    """Steps of training the whole model on after preparation, with this row's bottleneck in place when it
    has one (``cotrain.py``, cached); fine-tuning starts from those halves (0: from the shared halves)."""
    cut_teacher: int = 0
    """Co-training only: the weight, in percent, of distilling the control's next-token distributions
    (the same steps' co-training without a bottleneck) into this row's (0: cross-entropy alone)."""
    cut_warm: bool = False
    """Co-training only: start from the control's halves (calibrating the bottleneck on them) rather than
    the shared ones, so the row is the control compressed."""
    control: str = ""
    """The label of the row this one's quality is judged against besides none: a co-trained bottleneck's
    control, none's halves trained as long without it (``checks.compare_rows``)."""


def cut_key(row: Row) -> str:
    """What identifies a co-trained row's halves: its bottleneck's shape and training, not its codecs."""
    key = f"k{row.cut_k}-r{row.down_residual}-{row.up_residual}-ae{row.cut_pretrain}-co{row.cut_cotrain}"
    return key + (f"-kd{row.cut_teacher}" if row.cut_teacher else "") + ("-warm" if row.cut_warm else "")


@dataclass
class Prepared:
    """Everything both clusters hold before fine-tuning (each side only its own language)."""

    config: ModelConfig
    es: Tokenizer
    en: Tokenizer
    train_es: torch.Tensor
    train_en: torch.Tensor
    eval_es: torch.Tensor
    """The evaluated split's Spanish side (dev while tuning, test in a reported run), as token ids."""
    eval_en_text: list[str]
    encoder_state: dict[str, torch.Tensor]
    decoder_state: dict[str, torch.Tensor]
    pretrain_losses: dict[str, list[float]]
    translation_state: dict[str, dict[str, torch.Tensor]]
    """The adapter-wrapped halves after translation pre-training (``encoder``/``decoder``), or empty."""
    cut_states: dict[str, dict[str, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Co-trained rows' halves and bottleneck by ``cut_key`` (``cotrain.with_cut_states``)."""
