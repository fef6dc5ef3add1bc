"""The reward-model scorer against a direct call of the same model on one unpadded text."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

from tephra.episodes.rewards import RewardConfig, RewardError, RewardInput, RewardManager
from tephra.episodes.rewards.reward_model import RewardModelScorer

CORPUS = [
    "The answer is 42.",
    "Question: what is 6 times 7?",
    "I think it is 41, or maybe 43.",
] * 20


def save_tiny_reward_model(folder, num_labels=1):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"]))
    # No pad token on purpose: the scorer must fall back to eos.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=None,
    )
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


PROMPTS = [
    "Question: what is 6 times 7?",
    "Q: 6*7?",
    "",
    "Question: what is 6 times 7? Think.",
    "x",
]
RESPONSES = [
    " The answer is 42.",
    " 41",
    "I think it is 43, or maybe 42.",
    " 42",
    " The answer is 42. The answer is 42.",
]


def direct_scores(folder):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = LlamaForSequenceClassification.from_pretrained(folder).eval()
    scores = []
    with torch.no_grad():
        for prompt, response in zip(PROMPTS, RESPONSES):
            ids = tokenizer(prompt + response, return_tensors="pt")
            scores.append(model(**ids).logits[0, 0].item())  # one text: no padding at all
    return scores


def test_rewards_reward_model_matches_direct_call(reward_model_dir):
    expected = direct_scores(reward_model_dir)
    assert len(set(round(s, 4) for s in expected)) == len(
        expected
    )  # distinct texts, distinct scores
    # batch_size 3 over 5 texts of different lengths: two padded batches
    scorer = RewardModelScorer(reward_model_dir, batch_size=3)
    assert scorer.score(PROMPTS, RESPONSES) == pytest.approx(expected, abs=1e-5)

    config = RewardConfig(reward_model_path=str(reward_model_dir), reward_model_batch_size=2)
    items = [RewardInput("any", r, None, None, prompt_str=p) for p, r in zip(PROMPTS, RESPONSES)]
    with RewardManager(config) as manager:
        results = manager.score_batch(items)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-5)
    assert manager.last_report.items_by_source == {"any": 5}


def test_rewards_reward_model_bad_folders(tmp_path, reward_model_dir):
    with pytest.raises(RewardError, match="is not a Hugging Face model folder"):
        RewardModelScorer(tmp_path)
    two_labels = save_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardError, match="num_labels=2"):
        RewardModelScorer(two_labels)
    with pytest.raises(RewardError, match="has no chat template"):
        RewardModelScorer(reward_model_dir, use_chat_template=True)
