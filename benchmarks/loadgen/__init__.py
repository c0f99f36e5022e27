"""``pdserve bench``: a load generator for OpenAI-compatible servers.

spec.py      dataset options        datasets.py / traces.py  what to send
arrivals.py  when sessions start    runner.py                offering it, timing it
client.py    one streamed request   metrics.py               TTFT, ITL, TPOT, goodput
bench.py     a sweep of runs        report.py / plots.py     JSON, Markdown, PNG
"""
