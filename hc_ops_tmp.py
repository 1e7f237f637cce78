import sys, collections
from bench import guard, idembus_flow
from bench.common import orders as bench_orders
from idembus.messages import message_name
from samples.ordering.messages import OrderBilled
orders=32
flow = idembus_flow.build_flow("memory://", "memory", 2*orders, confirm=True)
sink = f"{flow.billing.name}-sink"
flow.transport.declare(sink, subscriptions=[message_name(OrderBilled)])
commands = list(bench_orders(2*orders))
for c in commands[:orders]: flow.sales.bus.send(c)
guard._process(flow)
for c in commands[orders:]: flow.sales.bus.send(c)
ops=collections.Counter()
def tracer(frame, event, arg):
    frame.f_trace_opcodes=True
    if event=='opcode':
        co=frame.f_code
        ops[(co.co_filename.split('site-packages/')[-1].replace('/work/wt/hC/',''), co.co_name)]+=1
    return tracer
sys.settrace(tracer)
import threading
guard._process(flow)
sys.settrace(None)
for e in flow.endpoints: e.close()
n=2*orders
bymod=collections.Counter()
for (f,fn),c in ops.items(): bymod[f]+=c
print("total bytecodes/msg", sum(ops.values())/n)
for k,v in bymod.most_common(40): print(f"{v/n:8.1f} {k}")
print()
for k,v in ops.most_common(60): print(f"{v/n:8.1f} {k}")
