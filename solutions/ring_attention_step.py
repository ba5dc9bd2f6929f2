"""Notebook 14: ring attention's step, a block's partial result merged by log-sum-exp."""

import torch


def my_combine(out, lse, block_out, block_lse):
    """Merge a block's attention (``block_out``, softmax over its keys, and ``block_lse``, the
    log-sum-exp of its scores, one per query) into the running one (``out``, ``lse``); return
    the output and log-sum-exp over both sets of keys."""
    new_lse = torch.logaddexp(lse, block_lse)  # log(exp(lse) + exp(block_lse)), no overflow
    keep = torch.exp(lse - new_lse).unsqueeze(-1)  # the running output's share
    take = torch.exp(block_lse - new_lse).unsqueeze(-1)  # the block's share
    return keep * out + take * block_out, new_lse
