"""One yardstick, two views: guidellm's client-side times next to the server's own, request by
request.

    python -m minicb serve --request-log /tmp/server.jsonl &
    guidellm run ... --output kind=json,path=/tmp/guidellm.json
    python -m minicb.bench.clients.compare /tmp/guidellm.json /tmp/server.jsonl

The two are matched by the response id (guidellm keeps "chatcmpl-63"; the server logs stream 63).
One vocabulary, the course's (minicb.metrics):
  - TTFT: from the request to its first generated token. The client counts from sending the HTTP
    request to receiving the first token's SSE chunk; the server from the moment its engine loop was
    handed the request (the JSON parsed, validated and tokenized) to the step that produced the
    token; "engine" counts from add_request, so server minus engine is the wait for the engine loop.
  - TPOT: a request's mean gap between consecutive output tokens, (last - first) / (tokens - 1).
    guidellm calls this "inter-token latency" (ITL); its "TPOT" divides the whole latency, first
    token included, by the tokens, a different number.
The client minus the server is what HTTP, JSON, SSE framing and the client's own loop cost.
"""

import argparse
import json
import statistics


def load(guidellm_json: str, server_jsonl: str) -> dict[str, list[tuple[dict, dict]]]:
    """{guidellm benchmark (e.g. "concurrent@4"): [(guidellm's request stats, the server's log
    line)]} for every request both saw."""
    server = {}
    with open(server_jsonl) as f:
        for line in f:
            rec = json.loads(line)
            server[rec["stream_id"]] = rec
    with open(guidellm_json) as f:
        report = json.load(f)
    found = {}
    for bench in report["benchmarks"]:
        strategy = bench.get("config", {}).get("strategy", {})
        name = f"{strategy.get('type_', 'run')}@{strategy.get('streams', len(found) + 1)}"
        for req in bench["requests"]["successful"]:
            stream_id = (req.get("response_id") or "").rsplit("-", 1)[-1]
            if stream_id in server:
                found.setdefault(name, []).append((req, server[stream_id]))
    return found


def rows(pairs: list[tuple[dict, dict]]) -> list[tuple[str, list[float], list[float]]]:
    """(what, client values in ms, server values in ms), one pair of lists per measure."""
    client_ttft = [c["time_to_first_token_ms"] for c, _ in pairs]
    client_gap = [c["inter_token_latency_ms"] for c, _ in pairs]
    client_latency = [c["request_latency"] * 1e3 for c, _ in pairs]
    server_ttft = [s["ttft_s"] * 1e3 for _, s in pairs]
    server_gap = [s["tpot_s"] * 1e3 for _, s in pairs]
    server_latency = [(s["finish"] - s["received"]) * 1e3 for _, s in pairs]
    engine_ttft = [s["engine_ttft_s"] * 1e3 for _, s in pairs]
    return [
        ("TTFT (server: from the engine loop)", client_ttft, server_ttft),
        ("TTFT (server: from add_request)", client_ttft, engine_ttft),
        ("TPOT = mean inter-token gap", client_gap, server_gap),
        ("request latency", client_latency, server_latency),
    ]


def table(pairs: list[tuple[dict, dict]], name: str = "") -> str:
    lines = [
        f"{name + ': ' if name else ''}{len(pairs)} requests seen by both guidellm and the server "
        "(ms; mean / median)",
        f"{'':38}{'guidellm (client)':>20}{'minicb (server)':>20}{'client - server':>20}",
    ]
    for what, client, server in rows(pairs):
        diff = [c - s for c, s in zip(client, server)]
        cell = lambda xs: f"{statistics.mean(xs):8.1f} /{statistics.median(xs):8.1f}"
        lines.append(f"{what:38}{cell(client):>20}{cell(server):>20}{cell(diff):>20}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minicb.bench.clients.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("guidellm_json", help="guidellm's --output kind=json file")
    parser.add_argument(
        "server_jsonl", help="the file given to python -m minicb serve --request-log"
    )
    args = parser.parse_args(argv)
    found = load(args.guidellm_json, args.server_jsonl)
    if not found:
        raise SystemExit(
            "no request is in both files: was the server started with --request-log, and "
            "did guidellm run against it?"
        )
    print("\n\n".join(table(pairs, name) for name, pairs in found.items()))


if __name__ == "__main__":
    main()
