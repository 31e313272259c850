"""The drafter service: proposes k tokens per round over gRPC, on the worker server (specmesh/worker/).

    cli.py          `drafter serve`: the worker's shared flags plus the drafter's own; __main__.py runs it
    config.py       the drafter's settings: the model or method it drafts with, batching across sessions
    service.py      the Drafter gRPC servicer and the drafter's role on the worker server
    proposer.py     what a drafter is to its service (the Proposer protocol)
    engine.py       drafting with a draft model on a session's KV cache, batched across sessions
    ngram.py        model-free drafting by prompt lookup (--method ngram)
    suffix.py       SuffixDecoding (--method suffix), over suffix_tree.py's counted suffix trees
"""
