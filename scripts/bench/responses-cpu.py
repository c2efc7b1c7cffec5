"""The router's CPU per turn, Responses against chat (issue 52): one
simulator (16 output tokens), one agent, one router (release binaries),
N conversations of 5 turns each, one at a time, as chat with the history
kept by the client and as Responses with previous_response_id, twice
each; the on-CPU time of each router thread (schedstat, nanoseconds) over
each run, per turn. Run from a scratch directory:

  HIVENET_ROUTER_ADMIN_API_KEYS=x python3 scripts/bench/responses-cpu.py BIN_DIR [N]
"""
import json, os, subprocess, sys, time, urllib.request, socket
BIN=sys.argv[1]
def fp():
    s=socket.socket(); s.bind(("127.0.0.1",0)); p=s.getsockname()[1]; s.close(); return p
def threads(pid):
    out={}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name=open(f"/proc/{pid}/task/{t}/comm").read().strip()
            ns=int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
            out[name]=out.get(name,0)+ns
        except Exception: pass
    return out
def post(port, path, body):
    req=urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type":"application/json"})
    with urllib.request.urlopen(req, timeout=30) as r: return json.loads(r.read())
simp, http, met, p2p = fp(), fp(), fp(), fp()
procs=[]
procs.append(subprocess.Popen([f"{BIN}/hivenet-sim","--port",str(simp),"--model","m","--output-tokens","16","--itl","1ms","--ttft","1ms"],stdout=open("sim.log","w"),stderr=subprocess.STDOUT))
r=subprocess.Popen([f"{BIN}/hivenet-router","--http-port",f"127.0.0.1:{http}","--metrics-port",f"127.0.0.1:{met}","--p2p-port",str(p2p),"--shards","1","--disk-db-path","db"],stdout=open("router.log","w"),stderr=subprocess.STDOUT)
procs.append(r)
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{http}/health"); break
    except Exception: time.sleep(0.1)
procs.append(subprocess.Popen([f"{BIN}/hivenet-agent","--router-p2p",f"/ip4/127.0.0.1/tcp/{p2p}","--backend-url",f"http://127.0.0.1:{simp}","--identity-path","a.key"],stdout=open("agent.log","w"),stderr=subprocess.STDOUT))
for _ in range(100):
    try:
        if '"healthy":1' in urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models").read().decode().replace(" ",""): break
    except Exception: pass
    time.sleep(0.1)
N=int(sys.argv[2]) if len(sys.argv)>2 else 40
instr="You are terse. "*40
try:
    for mode in ["chat","responses","chat","responses"]:
        t0=threads(r.pid); w0=time.time()
        for c in range(N):
            prev=None; hist=[{"role":"system","content":instr}]
            for t in range(5):
                q=f"Conversation {c} turn {t}: tell me about rivers."
                if mode=="chat":
                    hist.append({"role":"user","content":q})
                    out=post(http,"/v1/chat/completions",{"model":"m","messages":hist,"max_tokens":16})
                    hist.append({"role":"assistant","content":out["choices"][0]["message"]["content"]})
                else:
                    b={"model":"m","instructions":instr,"input":q,"max_output_tokens":16}
                    if prev: b["previous_response_id"]=prev
                    prev=post(http,"/v1/responses",b)["id"]
        t1=threads(r.pid); wall=time.time()-w0
        per={k:(t1.get(k,0)-t0.get(k,0))/1e3/(N*5) for k in t1}
        print(mode, f"wall/turn {wall*1e3/(N*5):.2f} ms", {k:round(v,1) for k,v in sorted(per.items()) if v>0.5}, "total us/turn", round(sum(per.values()),1))
finally:
    for p in procs: p.kill()
