"""`pagoda bench serve`: load an OpenAI-compatible server over HTTP and measure what its clients see.

    target   --url (a running server), or a pagoda started here (`pagoda serve --port 0`, a child
             process: server.py); --peer-url runs the same load against a second server, for pagoda / peer
             ratios (peer.py starts one with --peer-command); --offline-baseline the same load on the same
             engine without HTTP (offline.py); --transformers a floor of transformers' generate (baseline.py)
    load     closed-loop concurrency levels (--concurrency 1,4,16), or open-loop Poisson rates
             (--request-rate 2,8), or the chat workload's conversations (one level) (load.py, workloads.py);
             or tenants with a key each side by side (--tenant-mix A:64,B:1), one server per --scheduling-policy
             (tenant_mix.py)
    measure  per request TTFT, inter-token gaps, TPOT, end to end (client.py: through the endpoints' own client
             halves, pagoda's and an OpenAI-compatible peer's alike); per level percentiles, req/s, output tok/s,
             goodput under --slo-* (report.py); and for a pagoda, the server's own queue / prefill / decode
             split, from /metrics scraped around each level

Requests stream with a fixed output length (ignore_eos + max_tokens), so two servers generate the same number
of tokens for the same load. The command itself is sweep.py.
"""
