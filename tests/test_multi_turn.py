"""Multi-turn episodes on a real engine: token in, token out; environment ids appended, never trained."""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

from lightning_offpolicy.batch import PromptBatch
from lightning_offpolicy.correction import PolicyLossConfig
from lightning_offpolicy.correction.config import preset
from lightning_offpolicy.data.chat import ChatRenderer, renderer_for
from lightning_offpolicy.data.environments import StepResult
from lightning_offpolicy.data.rewards import environment_reward
from lightning_offpolicy.data.tokenizers import CharTokenizer, HFTokenizer
from lightning_offpolicy.demo.tiny_bpe import CHATML_TEMPLATE, tiny_config, train_bpe_tokenizer
from lightning_offpolicy.rollout import HFEngine, SamplingConfig
from lightning_offpolicy.rollout.dapo import DAPOSettings
from lightning_offpolicy.rollout.multi_turn import EpisodeRunner, EpisodeSettings
from lightning_offpolicy.rollout.partial import PartialStats, generate_resumable
from lightning_offpolicy.rollout.rollouter import RolloutControls, Rollouter
from lightning_offpolicy.train.step import apply_correction, corrected_loss
from tests.engine_contract import Replies
from tests.module_helpers import perturbed, tiny_model
from tests.test_partial_rollouts import teacher_forced

TEXTS = ["Count to three.", "Again.", "one two three", "Say more.", "Done now, 123 456 789."] * 4


class Again:
    """Answers "Again." until the model has spoken ``turns`` times; rewards 0.25 per reply."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, prompt, metadata) -> None:
        self.replies: list[str] = []
        self.secret = metadata["secret"]

    def step(self, reply: str) -> StepResult:
        self.replies.append(reply)
        done = len(self.replies) >= self.turns
        return StepResult(messages=[{"role": "user", "content": "Again."}], reward=0.25, done=done)


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    torch.manual_seed(0)
    raw = train_bpe_tokenizer(TEXTS, vocab_size=300, chat_template=CHATML_TEMPLATE)
    directory = tmp_path_factory.mktemp("tokenizer")
    raw.save_pretrained(directory)
    raw.saved_at = str(directory)
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", len(raw), raw.pad_token_id, raw.convert_tokens_to_ids("<|im_end|>"))
    model = AutoModelForCausalLM.from_config(config).eval()
    # A random model rarely ends a turn by itself: make <|im_end|> about one token in four. A large
    # constant in one embedding dimension dominates the final norm's input, so that dimension of
    # the normed state is about sqrt(hidden) at every position and the others are near 0: the
    # logits are near 0 except <|im_end|>'s, set to log(100) (100 / (100 + 299) ~ 1/4).
    im_end = raw.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[im_end, 0] = math.log(100.0) / math.sqrt(config.hidden_size)
    return model, raw


def _rollouter(model, raw, reward_fn, settings: EpisodeSettings, max_new_tokens: int = 6, **kwargs) -> Rollouter:
    engine = HFEngine(pad_token_id=raw.pad_token_id, eos_token_id=raw.convert_tokens_to_ids("<|im_end|>"))
    engine.update_weights(model, 0)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, samples_per_prompt=2)
    return Rollouter(engine, HFTokenizer(raw.saved_at), reward_fn, sampling, seed=3, episodes=settings, **kwargs)


def environment_reward_seen() -> tuple:
    """The environment's reward as the reward function, and the metadata rows it was called with."""
    seen: list[dict] = []

    def reward(prompts, completions, metadata):
        seen.extend(metadata)
        return environment_reward(prompts, completions, metadata)

    return reward, seen


def _prompts() -> PromptBatch:
    return PromptBatch(prompts=["Count to three.", "Say more."], metadata=[{"secret": 1}, {"secret": 2}])


def _teacher_forced_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def test_episodes_train_on_the_ids_the_engine_sampled_and_the_environment_ids_are_context(model_and_tokenizer):
    model, raw = model_and_tokenizer
    reward, seen = environment_reward_seen()

    rollouter = _rollouter(model, raw, reward, EpisodeSettings(environment=functools.partial(Again, 3), max_turns=3))
    rollout, _ = rollouter.rollout(_prompts(), index=0)
    renderer = ChatRenderer(raw)
    im_end = raw.convert_tokens_to_ids("<|im_end|>")
    observation = renderer.observation_ids([{"role": "user", "content": "Again."}], "<|im_end|>")
    mask = rollout.response_mask.bool()
    start = rollout.prompt_length
    retokenized_differs, finished = False, 0
    for row in range(rollout.num_sequences):
        response = rollout.input_ids[row, start:][rollout.attention_mask[row, start:].bool()].tolist()
        row_mask = mask[row, : len(response)].tolist()
        # Model turns end at <|im_end|>; each is followed by exactly the rendered observation, never trained.
        appended = [t for t, m in zip(response, row_mask, strict=True) if not m]
        turns = sum(1 for t, m in zip(response, row_mask, strict=True) if m and t == im_end)
        if turns == 3:
            assert appended == observation * 2
            finished += 1
        text = raw.decode(response, skip_special_tokens=False)
        retokenized_differs |= raw(text, add_special_tokens=False)["input_ids"] != response
    assert finished >= 1, "the seeded rollout should hold an episode the environment ended"
    assert retokenized_differs, "the seeded rollout should contain a reply the tokenizer would encode otherwise"
    # Every model token's rollout logprob is the trainer's teacher-forced logprob of the very id in the batch.
    forced = _teacher_forced_logprobs(model, rollout.input_ids, rollout.attention_mask)[:, start - 1 :]
    torch.testing.assert_close(forced[mask], rollout.rollout_logprobs[mask], atol=2e-5, rtol=0)
    # What the reward is told, per episode.
    assert len(seen) == 4 and all(
        set(m) >= {"secret", "turns", "truncated", "environment_reward", "transcript"} for m in seen
    )
    for m in seen:
        # The environment ends an episode at its third reply; a turn cut at its token budget ends it
        # earlier (or at the third turn) as truncated, unanswered by the environment.
        assert m["truncated"] or m["turns"] == 3
        assert m["environment_reward"] == pytest.approx(0.25 * (m["turns"] - m["truncated"]))
    stats = rollouter.last_stats
    assert stats["turns_per_episode"] == pytest.approx(sum(m["turns"] for m in seen) / 4)
    assert stats["truncated_frac"] == pytest.approx(sum(m["truncated"] for m in seen) / 4)
    assert stats["model_tokens_per_episode"] == pytest.approx(float(mask.sum()) / 4)


def test_environment_tokens_carry_no_weight_in_the_correction_or_the_gradient(model_and_tokenizer):
    model, raw = model_and_tokenizer
    rollouter = _rollouter(
        model,
        raw,
        lambda p, c, m: [float(len(x["transcript"])) for x in m],
        EpisodeSettings(environment=functools.partial(Again, 3)),
    )
    rollout, _ = rollouter.rollout(_prompts(), index=1)
    assert rollout.advantages.abs().sum() > 0
    appended = (rollout.response_mask == 0) & (rollout.attention_mask[:, rollout.prompt_length :] == 1)
    assert appended.any()
    correction = preset("geo_mis_seq_tis")
    loss_config = PolicyLossConfig()
    results = []
    for garbage in (0.0, 5.0):
        noise = torch.full_like(rollout.rollout_logprobs, garbage) * appended
        batch = rollout.with_fields(rollout_logprobs=rollout.rollout_logprobs + noise)
        prox = rollout.rollout_logprobs - 0.01 + noise * 3
        corrected, stats = apply_correction(batch, prox, correction)
        logprobs = (rollout.rollout_logprobs + 0.05 - noise).clone().requires_grad_(True)
        loss, _ = corrected_loss(logprobs, corrected, loss_config, correction)
        loss.backward()
        results.append((loss.detach(), logprobs.grad, stats))
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = results
    assert torch.equal(grad_a[appended], torch.zeros_like(grad_a[appended]))
    assert grad_a[rollout.response_mask.bool()].abs().sum() > 0
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(grad_a, grad_b, rtol=0, atol=0)
    for name, value in vars(stats_a).items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, getattr(stats_b, name), rtol=0, atol=0, equal_nan=True, msg=name)


def test_limits_end_episodes_as_truncated(model_and_tokenizer):
    model, raw = model_and_tokenizer
    seen: list[dict] = []

    def reward(prompts, completions, metadata):
        seen.extend(metadata)
        return [0.0] * len(metadata)

    # One turn allowed, and the environment wants three: every episode that finishes its turn is truncated.
    rollouter = _rollouter(model, raw, reward, EpisodeSettings(environment=functools.partial(Again, 3), max_turns=1))
    rollouter.rollout(_prompts(), index=0)
    assert [m["turns"] for m in seen] == [1] * 4 and all(m["truncated"] for m in seen)
    # An episode budget smaller than one turn plus what the environment appends.
    seen.clear()
    rollouter = _rollouter(
        model,
        raw,
        reward,
        EpisodeSettings(environment=functools.partial(Again, 3), max_episode_tokens=8),
        max_new_tokens=40,
    )
    rollout, _ = rollouter.rollout(_prompts(), index=0)
    assert all(m["turns"] == 1 and m["truncated"] for m in seen)
    assert int(rollout.response_mask.sum(-1).max()) <= 8


def test_episode_settings_are_checked():
    with pytest.raises(ValueError, match="not both"):
        EpisodeSettings(tools=["math.sqrt"], environment=Again)
    with pytest.raises(ValueError, match=r"EpisodeSettings.max_turns=0 must be an int >= 1"):
        EpisodeSettings(environment=Again, max_turns=0)
    with pytest.raises(ValueError, match="tool_timeout_s"):
        EpisodeSettings(tool_timeout_s=-1.0)
    assert not EpisodeSettings().enabled and EpisodeSettings(environment=Again).enabled
    assert math.isfinite(EpisodeSettings().max_episode_tokens)


class PushInsideTheSecondTurn:
    """A ``turn`` guard: interrupts the 2nd generate call (the episodes' 2nd turn) at its 3rd forward pass,
    and pushes ``new`` as version 1 before the 3rd call (the continuation of the cut turn)."""

    def __init__(self, engine, new: torch.nn.Module) -> None:
        self.engine, self.new, self.calls = engine, new, 0

    @contextlib.contextmanager
    def __call__(self):
        self.calls += 1
        if self.calls == 3:
            self.engine.update_weights(self.new, 1)
        forwards = {"n": 0}

        def hook(*_):
            forwards["n"] += 1
            if forwards["n"] == 3:
                self.engine.interrupt()

        handle = self.engine.model.register_forward_hook(hook) if self.calls == 2 else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()


def test_a_turn_cut_by_a_weight_push_continues_under_the_new_weights_with_each_tokens_version():
    old = tiny_model()
    new = perturbed(old, 0.3)
    # Several stop ids: the random policy ends its turns after a few tokens.
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=2, stop_token_ids=[2, 5, 9, 14, 20, 27, 33, 40])
    engine.update_weights(old, version=0)
    settings = EpisodeSettings(environment=functools.partial(Replies, 2), max_turns=2, max_episode_tokens=40)
    runner = EpisodeRunner(settings, CharTokenizer(), stop_ids=engine.stop_ids)
    prompts = ["abc", "hello"]
    turn, stats = PushInsideTheSecondTurn(engine, new), PartialStats()

    def generate(ids, sampling, seed):
        return generate_resumable(engine, ids, sampling, seed=seed, turn=turn, stats=stats)

    sampling = SamplingConfig(max_new_tokens=12, samples_per_prompt=2)
    episodes = runner.run(prompts, [{}, {}], runner.prompt_ids(prompts), sampling, generate, seed=0, group_offset=0)
    assert stats.interrupted >= 1 and stats.continuation_calls >= 1
    spanning = 0
    for episode in episodes:
        first, *rest = episode.turns
        assert first.completion.token_versions() == [0] * len(first.completion.token_ids)
        context = episode.prompt_ids + first.completion.token_ids + first.observation_ids
        for later in rest:
            versions, tokens = later.completion.token_versions(), later.completion.token_ids
            cut = versions.count(0)
            assert versions == [0] * cut + [1] * (len(tokens) - cut)
            spanning += 0 < cut < len(tokens)
            logprobs = torch.tensor(later.completion.logprobs, dtype=torch.float64)
            torch.testing.assert_close(logprobs[:cut], teacher_forced(old, context, tokens)[:cut], atol=3e-4, rtol=0)
            torch.testing.assert_close(logprobs[cut:], teacher_forced(new, context, tokens)[cut:], atol=3e-4, rtol=0)
        # The staleness bound reads the oldest model token: the appended ids never make an episode older.
        versions = episode.token_versions()
        model_versions = [v for v, m in zip(versions, episode.model_mask(), strict=True) if m]
        assert min(versions) == min(model_versions) == 0
    assert spanning >= 1, "a turn should have been cut by the push and continued under the new weights"


class GymStyle:
    """Answers each reply with what it was made with: a gym-style tuple, ``None``, ..."""

    def __init__(self, returned: object) -> None:
        self.returned = returned

    def reset(self, prompt, metadata) -> None:
        pass

    def step(self, reply: str) -> object:
        return self.returned


TO_RETURN = (
    " Return lightning_offpolicy.data.environments.StepResult(messages=[{'role': 'user', 'content': ...}], "
    "reward=..., done=...) from step (docs/environments.md, 'The contract')."
)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (
            ("Higher.", 0.0, False, False, {}),
            "GymStyle.step returned a tuple (('Higher.', 0.0, False, False, {})), not a StepResult. A gym-style "
            "(observation, reward, done, ...) tuple is not read." + TO_RETURN,
        ),
        (None, "GymStyle.step returned None, not a StepResult." + TO_RETURN),
        # A long observation is shown shortened.
        ("x" * 1000, "GymStyle.step returned a str ('xxxxxxxxxxxx...xxxxxxxxxxxxx'), not a StepResult." + TO_RETURN),
    ],
)
def test_an_environment_step_returning_no_step_result_is_named_with_what_to_return(returned, message):
    # Every id ends a turn: the first turn is one stop token, and the environment answers it.
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=2, stop_token_ids=list(range(64)))
    engine.update_weights(tiny_model(), version=0)
    runner = EpisodeRunner(
        EpisodeSettings(environment=functools.partial(GymStyle, returned)), CharTokenizer(), engine.stop_ids
    )
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=1)
    with pytest.raises(TypeError) as raised:
        runner.run(["abc"], [{}], runner.prompt_ids(["abc"]), sampling, engine.generate, seed=0, group_offset=0)
    assert str(raised.value) == message


def test_held_out_evaluation_plays_episodes_and_scores_each_one(model_and_tokenizer):
    model, raw = model_and_tokenizer
    reward, seen = environment_reward_seen()

    rollouter = _rollouter(model, raw, reward, EpisodeSettings(environment=functools.partial(Again, 2)))
    evaluation = rollouter.evaluate(_prompts())
    # One greedy and two sampled episodes per prompt, each scored with what its environment said.
    assert len(seen) == 6 and all("transcript" in m for m in seen)
    assert evaluation.greedy_rewards.tolist() == [m["environment_reward"] for m in seen[:2]]
    assert evaluation.sampled_rewards.flatten().tolist() == [m["environment_reward"] for m in seen[2:]]
    # Lengths count the model's tokens only; the same held-out episodes come back at the next evaluation.
    again = rollouter.evaluate(_prompts())
    torch.testing.assert_close(again.sampled_rewards, evaluation.sampled_rewards)
    torch.testing.assert_close(again.greedy_lengths, evaluation.greedy_lengths)
    assert float(evaluation.greedy_lengths.max()) <= 2 * 8


def test_dynamic_sampling_keeps_the_groups_of_informative_episodes(model_and_tokenizer):
    model, raw = model_and_tokenizer
    extra = iter([_prompts()] * 4)

    def reward(prompts, completions, metadata):
        return [float(m["turns"]) for m in metadata]

    rollouter = _rollouter(
        model,
        raw,
        reward,
        EpisodeSettings(environment=functools.partial(Again, 3)),
        dapo=DAPOSettings(dynamic_sampling=True),
        controls=RolloutControls(more_prompts=lambda: next(extra)),
    )
    rollout, _ = rollouter.rollout(_prompts(), index=2)
    stats = rollouter.last_stats
    groups = rollout.group_ids.tolist()
    rewards = rollout.rewards.tolist()
    by_group: dict[int, set] = {}
    for group, value in zip(groups, rewards, strict=True):
        by_group.setdefault(group, set()).add(value)
    # Two groups (as many as prompts), each of episodes with different rewards, found by refilling.
    assert stats["groups_short"] == 0 and len(by_group) == 2, (stats, by_group)
    assert all(len(values) > 1 for values in by_group.values()), by_group
    assert stats["groups_dropped"] + stats["refill_batches"] > 0 and "turns_per_episode" in stats


def test_rendering_errors_name_what_to_do(model_and_tokenizer):
    _, raw = model_and_tokenizer
    with pytest.raises(ValueError, match="Tools are shown to the model by its tokenizer's chat template"):
        renderer_for(CharTokenizer(), [environment_reward])
    # A template that renders the number of messages first is not prefix-preserving.
    counting = "{{ messages | length }}" + CHATML_TEMPLATE
    raw_counting = train_bpe_tokenizer(TEXTS, vocab_size=300, chat_template=counting)
    with pytest.raises(ValueError, match="not prefix-preserving"):
        ChatRenderer(raw_counting).observation_ids([{"role": "user", "content": "Again."}], "<|im_end|>")
    with pytest.raises(KeyError, match="did not run in an environment"):
        environment_reward(["p"], ["c"], [{}])
    # Without a template, an environment's messages follow as plain text (a space for the character tokenizer).
    plain = renderer_for(CharTokenizer())
    assert plain.observation_ids([{"role": "user", "content": "again"}], "") == CharTokenizer().encode(
        " again ", add_bos=False
    )


def test_episodes_at_top_p_carry_each_model_tokens_kept_support_and_none_at_appended_ids(model_and_tokenizer):
    model, raw = model_and_tokenizer
    engine = HFEngine(pad_token_id=raw.pad_token_id, eos_token_id=raw.convert_tokens_to_ids("<|im_end|>"))
    engine.update_weights(model, 0)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, samples_per_prompt=2)
    reward, _ = environment_reward_seen()
    settings = EpisodeSettings(environment=functools.partial(Again, 3))
    rollouter = Rollouter(engine, HFTokenizer(raw.saved_at), reward, sampling, seed=3, episodes=settings)
    rollout, _ = rollouter.rollout(_prompts(), index=0)
    rollout.validate()
    support = rollout.sampling_support
    start = rollout.prompt_length
    trained = rollout.response_mask.bool()
    appended = ~trained & rollout.attention_mask[:, start:].bool()
    assert appended.any() and support is not None
    tokens = rollout.input_ids[:, start:]
    # Every model token is among the ids its sampler kept; an appended id has no kept set (it never trains).
    assert ((support == tokens.unsqueeze(-1)).any(-1) | ~trained).all()
    assert (support[appended] == -1).all()
    assert rollouter.last_stats["support_unknown_frac"] == 0.0


class FailingTool:
    """Reports one failed tool call per reply (as ToolEnvironment does for a tool that always raises), then ends."""

    def reset(self, prompt, metadata) -> None:
        pass

    def step(self, reply: str) -> StepResult:
        message = {"role": "tool", "name": "boom", "content": "{'error': 'boom'}"}
        return StepResult(messages=[message], tool_calls=1, tool_errors=1, done=True)


def _one_token_turns(settings: EpisodeSettings) -> tuple[EpisodeRunner, HFEngine]:
    """A runner over a real engine whose every id ends a turn: each reply is one token."""
    engine = HFEngine(dtype="float32", pad_token_id=0, eos_token_id=2, stop_token_ids=list(range(64)))
    engine.update_weights(tiny_model(), version=0)
    return EpisodeRunner(settings, CharTokenizer(), engine.stop_ids), engine


def _play(runner: EpisodeRunner, engine: HFEngine, prompts: list[str]) -> list:
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2)
    ids = runner.prompt_ids(prompts)
    return runner.run(prompts, [{"secret": 0}] * len(prompts), ids, sampling, engine.generate, seed=0, group_offset=0)


def test_a_budget_no_environment_message_fits_is_named_once():
    """max_episode_tokens=3: the first reply fits, "again" after it never does, so every episode is cut; the
    warning names the setting and why, once per runner (not every batch)."""
    replies = functools.partial(Replies, 3)
    runner, engine = _one_token_turns(EpisodeSettings(environment=replies, max_episode_tokens=3))
    with pytest.warns(UserWarning) as record:
        episodes = _play(runner, engine, ["abc", "de"])
    assert all(e.truncated for e in episodes) and len(episodes) == 4
    (message,) = [str(w.message) for w in record]
    assert message.startswith("Every one of the 4 episodes of a batch was truncated by a limit")
    assert "(rollout.episodes.max_episode_tokens (an environment message did not fit): 4)" in message
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _play(runner, engine, ["abc"])  # all cut again: no second warning
    roomy, engine = _one_token_turns(EpisodeSettings(environment=replies, max_episode_tokens=64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not any(e.truncated for e in _play(roomy, engine, ["abc"]))


def test_a_tool_that_fails_every_call_is_named_once():
    runner, engine = _one_token_turns(EpisodeSettings(environment=FailingTool))
    failed = r"Every one of the 4 tool calls of a batch failed: .*rollout\.episodes\.tools"
    with pytest.warns(UserWarning, match=failed):
        episodes = _play(runner, engine, ["abc", "de"])
    assert [e.tool_errors for e in episodes] == [1] * 4


def test_a_preemption_abandons_the_environment_steps_not_yet_started():
    """Stopped while the first episode's tool runs: the other episodes' steps are not started (each could take
    its tool's whole timeout), and the runner raises RolloutStopped at once. One step at a time here; side by
    side: tests/test_concurrent_env_steps.py."""
    from lightning_offpolicy.rollout.partial import RolloutStopped

    steps: list[str] = []

    class SlowTool:
        def reset(self, prompt, metadata) -> None:
            pass

        def step(self, reply: str) -> StepResult:
            steps.append(reply)  # the preemption arrives while this call runs
            return StepResult(messages=[{"role": "tool", "name": "slow", "content": "1"}], tool_calls=1)

    runner, engine = _one_token_turns(EpisodeSettings(environment=SlowTool, max_concurrent_env_steps=1))
    sampling = SamplingConfig(max_new_tokens=4, samples_per_prompt=2)
    ids = runner.prompt_ids(["abc", "de"])
    with pytest.raises(RolloutStopped, match="environment steps"):
        runner.run(["abc", "de"], [{}, {}], ids, sampling, engine.generate, 0, 0, stop=lambda: bool(steps))
    assert len(steps) == 1  # of 4 episodes
