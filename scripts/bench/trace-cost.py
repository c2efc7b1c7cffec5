"""What tracing costs the router (issue 53): one simulator, one agent
linked to two routers (release binaries) side by side, one with tracing
off, one exporting every trace (OTEL_TRACES_SAMPLER=always_on) to a real
OTLP receiver (Arize Phoenix, scripts/install-phoenix.sh); N chat
requests one at a time to each, alternated twice; the on-CPU time of each
router thread (schedstat, ns) per request, and the spans exported and
dropped. Run from a scratch directory:

  HIVENET_ROUTER_ADMIN_API_KEYS=x python3 scripts/bench/trace-cost.py BIN_DIR [N] [PAIRS]

(instruction counts, which do not move with a noisy neighbour:
scripts/bench/callgrind-request.sh with and without the OTEL_* variables)
"""
import json, os, subprocess, sys, time, urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lib import free_port as fp, thread_cpu_ns as threads, wait_http
BIN=sys.argv[1]
N=int(sys.argv[2]) if len(sys.argv)>2 else 2000
PAIRS=int(sys.argv[3]) if len(sys.argv)>3 else 6
ROOT=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def metric(port, name):
    for l in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        if l.startswith(name):
            yield l
body=json.dumps({"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}).encode()
def post(port):
    req=urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type":"application/json"})
    with urllib.request.urlopen(req, timeout=30) as r: r.read()
procs=[]
try:
    phx=subprocess.run([f"{ROOT}/scripts/install-phoenix.sh"],capture_output=True,text=True,check=True).stdout
    phoenix=[l.split("=",1)[1] for l in phx.splitlines() if l.startswith("PHOENIX=")][0]
    pport,gport=fp(),fp()
    os.makedirs("phx",exist_ok=True)
    procs.append(subprocess.Popen([phoenix,"serve"],env={**os.environ,"PHOENIX_WORKING_DIR":os.path.abspath("phx"),"PHOENIX_PORT":str(pport),"PHOENIX_GRPC_PORT":str(gport),"PHOENIX_HOST":"127.0.0.1","PHOENIX_TELEMETRY_ENABLED":"false"},stdout=open("phoenix.log","w"),stderr=subprocess.STDOUT))
    wait_http(pport, "/healthz", limit=180)
    simp=fp()
    procs.append(subprocess.Popen([f"{BIN}/hivenet-sim","--port",str(simp),"--model","m","--output-tokens","16","--itl","0ms","--ttft","0ms"],stdout=open("sim.log","w"),stderr=subprocess.STDOUT))
    routers={}
    for mode in ["off","on"]:
        http,met,p2p=fp(),fp(),fp()
        env=dict(os.environ)
        if mode=="on":
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT":f"http://127.0.0.1:{pport}","OTEL_TRACES_SAMPLER":"always_on","OTEL_BSP_SCHEDULE_DELAY":"1000"})
        os.makedirs(mode,exist_ok=True)
        p=subprocess.Popen([f"{BIN}/hivenet-router","--http-port",f"127.0.0.1:{http}","--metrics-port",f"127.0.0.1:{met}","--p2p-port",str(p2p),"--shards","1","--disk-db-path",f"{mode}/db"],env=env,stdout=open(f"router-{mode}.log","w"),stderr=subprocess.STDOUT)
        procs.append(p); routers[mode]=(p,http,met,p2p)
        wait_http(http)
    args=[f"{BIN}/hivenet-agent","--backend-url",f"http://127.0.0.1:{simp}","--identity-path","a.key"]
    for m in routers.values(): args+=["--router-p2p",f"/ip4/127.0.0.1/tcp/{m[3]}"]
    procs.append(subprocess.Popen(args,stdout=open("agent.log","w"),stderr=subprocess.STDOUT))
    for m in routers.values():
        for _ in range(100):
            try:
                if '"healthy":1' in urllib.request.urlopen(f"http://127.0.0.1:{m[1]}/v1/models").read().decode().replace(" ",""): break
            except Exception: pass
            time.sleep(0.1)
    for m in routers.values():
        for _ in range(200): post(m[1])
    res={"off":[],"on":[]}
    for mode in ["off","on"]*PAIRS:
        p,http,met,_=routers[mode]
        t0=threads(p.pid); w0=time.time()
        for _ in range(N): post(http)
        t1=threads(p.pid); wall=time.time()-w0
        per={k:(t1.get(k,0)-t0.get(k,0))/1e3/N for k in t1}
        tot=sum(per.values()); res[mode].append(tot)
        print(mode, f"wall/request {wall*1e3/N:.3f} ms", {k:round(v,2) for k,v in sorted(per.items()) if v>0.05}, "total us/request", round(tot,2), flush=True)
    time.sleep(2)
    _,_,met,_=routers["on"]
    print("exported:", list(metric(met,"hivenet_trace_spans_exported_total")))
    print("dropped:", list(metric(met,"hivenet_trace_spans_dropped_total{")))
    d=[b-a for a,b in zip(res["off"],res["on"])]
    print("on - off, us/request, per pair:", [round(x,2) for x in d])
    d.sort()
    print("on - off, median of pairs:", round(d[len(d)//2],2), "us/request")
    # The receiver up, frozen (SIGSTOP), then killed: the traced router's
    # latency against the untraced one's, request by request interleaved
    # (one client, so a slower request shows), and its drops.
    phx=procs[0]
    def lat(port):
        t=time.perf_counter(); post(port); return (time.perf_counter()-t)*1e3
    def pct(xs,q): xs=sorted(xs); return xs[min(len(xs)-1,int(q*len(xs)))]
    for phase in ["receiver up","receiver frozen","receiver killed"]:
        if phase=="receiver frozen": phx.send_signal(19)
        if phase=="receiver killed": phx.send_signal(9); phx.send_signal(18)
        off_l=[]; on_l=[]
        for _ in range(N):
            off_l.append(lat(routers["off"][1])); on_l.append(lat(routers["on"][1]))
        print(f"{phase}: off p50 {pct(off_l,.5):.3f} p99 {pct(off_l,.99):.3f} max {max(off_l):.3f} ms; on p50 {pct(on_l,.5):.3f} p99 {pct(on_l,.99):.3f} max {max(on_l):.3f} ms; on/off p99 {pct(on_l,.99)/pct(off_l,.99):.2f}", flush=True)
        print("  dropped:", list(metric(routers["on"][2],"hivenet_trace_spans_dropped_total{")), flush=True)
finally:
    for p in procs: p.kill()
