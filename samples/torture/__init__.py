"""The exactly-once torture test: the ordering sample in worker processes, under fire.

``python -m samples.torture --orders 10000`` (``make torture``) deploys
:mod:`samples.ordering.deployment` on RabbitMQ and PostgreSQL with three ``idembus run
--workers 3`` supervisors, sends the orders (a share of them twice with the same message
id), SIGKILLs a random worker every ~2 s, restarts RabbitMQ once mid-run, waits for
quiescence and prints one line read from the stores (wrapped here)::

    orders=N placed=N billed=N shipped=N charges=N kills=K broker_restarts=1
    error_queue=0 lost=0 double_effects=0

Its exit status is 0 only if every figure is right. The modules, one job each:

``options``     the command line
``logwatch``    reads a process's output into a log file and waits for lines in it
``workers``     starts, watches and stops the three supervisors; lists their workers
``rabbitmq``    queue depths and consumers; ``rabbitmqctl stop_app`` / ``start_app``
``driver``      sends the orders, retrying through broker outages with the same ids
``chaos``       kills workers; restarts the broker once
``quiescence``  waits until every order is shipped and the queues stay empty
``report``      the line, read from the stores
``run``         puts them together and cleans up
"""
