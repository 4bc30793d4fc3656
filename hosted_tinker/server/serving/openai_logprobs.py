"""The ``logprobs`` of an OpenAI answer, a chat completion's and a completion's, from a sampled
sequence and its top-k alternatives (``token_str``: a token's text, special tokens included)."""

from __future__ import annotations

from collections.abc import Callable

from hosted_tinker.core.sampling import MASK_LOGPROB, SampledSequence
from hosted_tinker.server.protocol import openai_types as oai

TokenStr = Callable[[int], str]


def alternatives(seq: SampledSequence, i: int) -> tuple[list[int], list[float]]:
    """The top-k tokens and log-probs at ``seq``'s ``i``-th sampled token (none if not asked)."""
    if seq.topk is None:
        return [], []
    ids, lps = seq.topk[0][i].tolist(), seq.topk[1][i].tolist()
    filled = [j for j, lp in enumerate(lps) if lp != MASK_LOGPROB]
    return [ids[j] for j in filled], [lps[j] for j in filled]


def chat_logprobs(seq: SampledSequence, token_str: TokenStr) -> oai.ChoiceLogprobs:
    content = []
    for i, (token, lp) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
        text = token_str(token)
        content.append(
            oai.ChatTokenLogprob(
                token=text,
                logprob=lp,
                bytes=list(text.encode()),
                top_logprobs=[
                    oai.TopLogprob(token=token_str(t), logprob=v, bytes=list(token_str(t).encode()))
                    for t, v in zip(*alternatives(seq, i), strict=True)
                ],
            )
        )
    return oai.ChoiceLogprobs(content=content)


def completion_logprobs(seq: SampledSequence, token_str: TokenStr) -> oai.CompletionLogprobs:
    tokens = [token_str(t) for t in seq.tokens]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if seq.topk is not None:
        top = [{token_str(t): v for t, v in zip(*alternatives(seq, i), strict=True)} for i in range(len(seq.tokens))]
    return oai.CompletionLogprobs(tokens=tokens, token_logprobs=[*seq.logprobs], top_logprobs=top, text_offset=offsets)
