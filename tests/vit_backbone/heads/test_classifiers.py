"""The kNN vote and the softmax regression on hand-made data, with values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vit_backbone.errors import InvalidOptionError
from vit_backbone.heads.knn import fit_knn, knn_proba
from vit_backbone.heads.linear import fit_softmax


def test_knn_votes_are_exp_similarity_over_temperature() -> None:
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])  # unit rows
    labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0, 0.0]])
    proba = knn_proba(query, bank, labels, 2, k=2, temperature=0.07)
    # top-2 similarities: 1.0 (class 0) and 0.6 (class 1)
    w0, w1 = math.exp(1.0 / 0.07), math.exp(0.6 / 0.07)
    expected = torch.tensor([[w0 / (w0 + w1), w1 / (w0 + w1)]], dtype=torch.float32)
    torch.testing.assert_close(proba, expected, atol=1e-7, rtol=1e-6)
    all_three = knn_proba(query, bank, labels, 2, k=10, temperature=1.0)  # k capped at the bank size
    w = [math.exp(1.0), math.exp(0.0), math.exp(0.6)]
    torch.testing.assert_close(
        all_three, torch.tensor([[w[0] / sum(w), (w[1] + w[2]) / sum(w)]]), atol=1e-7, rtol=1e-6
    )


def test_knn_picks_k_on_the_held_out_split() -> None:
    rng = np.random.default_rng(0)
    centres = np.asarray([[1.0, 0, 0], [0, 1.0, 0]])
    x = np.concatenate([c + 0.1 * rng.standard_normal((30, 3)) for c in centres])
    y = np.repeat([0, 1], 30)
    fit = fit_knn(x[::2], y[::2], x[1::2], y[1::2], 2, ks=(1, 5, 100))
    assert fit.val_accuracy == 1.0
    assert fit.k == 1  # ties go to the smallest k
    assert fit.tried == {"1": 1.0, "5": 1.0, "30": 1.0}  # 100 is capped at the 30 training rows
    torch.testing.assert_close(fit.bank.norm(dim=1), torch.ones(30))


def test_softmax_regression_separates_and_chooses_the_decay() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5)) * [1, 1, 1, 1, 100] + [0, 0, 0, 0, 50]
    y = (x[:, 0] + x[:, 1] > 0).astype(int)  # a linear rule on two of five features
    fit = fit_softmax(x[:150], y[:150], x[150:], y[150:], 2, weight_decays=(1.0, 1e-4))
    assert fit.val_accuracy is not None and fit.val_accuracy >= 0.96
    assert set(fit.tried) == {"1", "0.0001"}
    assert fit.weight_decay == 1e-4 and fit.tried["0.0001"] > fit.tried["1"]  # the better one is kept
    assert fit.val_accuracy == fit.tried["0.0001"]
    torch.testing.assert_close(fit.params.mean, torch.tensor(x[:150].mean(0), dtype=torch.float32))
    predicted = fit.params.logits(torch.tensor(x[150:], dtype=torch.float32)).argmax(1).numpy()
    assert float((predicted == y[150:]).mean()) == fit.val_accuracy


def test_bad_training_input_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match=r"labels must be in 0..1"):
        fit_softmax(np.zeros((3, 2)), [0, 1, 2], None, None, 2)
    with pytest.raises(InvalidOptionError, match=r"expected features \[N, F\] and N labels"):
        fit_knn(np.zeros((3, 2)), [0, 1], None, None, 2)
