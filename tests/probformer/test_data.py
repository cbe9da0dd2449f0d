import pytest
import torch

from probformer.training import data


def test_ptb_is_available_offline_with_the_standard_counts():
    valid = data.ptb_sentences("valid")
    assert len(valid) == 3370
    assert sum(len(s) for s in valid) == 70390
    with pytest.raises(ValueError, match="unknown PTB split 'dev'"):
        data.ptb_sentences("dev")


def test_vocabulary_and_batches():
    sentences = [["a", "b", "a"], ["c"], ["b", "a"]]
    vocab = data.Vocabulary.build(sentences)
    assert vocab.words[:3] == ["<pad>", "<unk>", "<mask>"] and vocab.words[3] == "a"
    assert vocab.encode(["a", "zzz"]) == [3, 1]
    (tokens, mask), (tokens2, mask2) = list(data.batches(sentences, vocab, batch_size=2, max_length=3))
    assert tokens.shape == (2, 3) and mask.tolist() == [[True] * 3, [True, False, False]]
    assert tokens2.shape == (1, 2)
    with pytest.raises(ValueError, match="exceed max_length=2"):
        list(data.batches(sentences, vocab, batch_size=2, max_length=2))


def test_bert_masking_proportions():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (200, 100), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, 90:] = False
    inputs, targets = data.mask_tokens(tokens, mask, 1000, generator=g)
    picked = targets != -100
    assert not picked[:, 90:].any()
    assert abs(picked[:, :90].float().mean().item() - 0.15) < 0.01
    masked = (inputs == 2) & picked
    kept = (inputs == tokens) & picked
    assert abs(masked.sum().item() / picked.sum().item() - 0.8) < 0.02
    assert abs(kept.sum().item() / picked.sum().item() - 0.1) < 0.02  # (+ rare random hits)
    assert torch.equal(targets[picked], tokens[picked])
