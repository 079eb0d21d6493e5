# Cython's declarations for lchat/proxy/hot.py (pure-Python mode): its classes as cdef classes, the
# one-read path's locals typed. Every field is an object, named as in the .py's __slots__ (the test
# tests/test_proxy_hot.py holds the two lists equal), and exposed to Python as a slot is (a member
# descriptor, see _expose_slots): the general path's Python reads them as fast as it reads slots.
cimport cython


cdef extern from *:
    """
    #include <structmember.h>
    /* lchat.proxy.hot: where in an instance a field is, found by the object it was just given. */
    static Py_ssize_t lchat_hot_offset(PyObject *obj, PyObject *held) {
        Py_ssize_t size = Py_TYPE(obj)->tp_basicsize;
        Py_ssize_t at;
        for (at = sizeof(PyObject); at + (Py_ssize_t)sizeof(PyObject *) <= size;
             at += sizeof(PyObject *)) {
            if (*(PyObject **)((char *)obj + at) == held) return at;
        }
        PyErr_SetString(PyExc_RuntimeError, "lchat.proxy.hot: a field not found in its object");
        return -1;
    }
    /* The field at offset as a slot's member descriptor (T_OBJECT_EX) in the type's dict, in
       place of Cython's property: CPython specialises reading and writing a member. The
       definition and its name live as long as the type (never freed). */
    static int lchat_hot_expose(PyObject *type, PyObject *name, Py_ssize_t offset) {
        PyMemberDef *def = PyMem_Calloc(2, sizeof(PyMemberDef));
        PyObject *descr;
        int failed;
        if (def == NULL) { PyErr_NoMemory(); return -1; }
        Py_INCREF(name);
        def->name = PyUnicode_AsUTF8(name);
        if (def->name == NULL) return -1;
        def->type = T_OBJECT_EX;
        def->offset = offset;
        descr = PyDescr_NewMember((PyTypeObject *)type, def);
        if (descr == NULL) return -1;
        failed = PyDict_SetItem(((PyTypeObject *)type)->tp_dict, name, descr);
        Py_DECREF(descr);
        PyType_Modified((PyTypeObject *)type);
        return failed;
    }
    """
    Py_ssize_t lchat_hot_offset(object obj, object held) except -1
    int lchat_hot_expose(object type, object name, Py_ssize_t offset) except -1


cdef class HotStats:
    cdef public object accepted, bytes_down, bytes_up, connections, idle_upstream, in_flight
    cdef public object one_read, one_read_spliced, requests, tls_closed_at_once, tls_full
    cdef public object tls_resumed, upgraded


cdef class Exchange:
    cdef public object body, body_complete, body_size, bytes_out, chunked, client_closes
    cdef public object close_after
    cdef public object forwarded_for, head, header_bytes, headers, hop_waited, keep_alive
    cdef public object length, method, observed, origin, refused_by, refused_why, replay
    cdef public object replay_size, rerouted, response_chunked, response_complete
    cdef public object response_started, retried, started, status, streaming, target, upgrade
    cdef public object upgrade_tail, upstream, upstream_lines, url, version


cdef class ClientCore:
    cdef public object _access_log, _active, _batch, _body_deadline, _body_left, _buffers, _bulk
    cdef public object _client, _client_bytes, _closed, _completed, _deadline, _idle_action
    cdef public object _keepalive_timeout, _last_head, _last_request, _last_whole, _linger_until
    cdef public object _lost, _max_header_bytes, _max_headers, _output_paused, _parser, _parsing
    cdef public object _pool, _progress, _route, _seconds, _send_buffered, _send_moved_at
    cdef public object _served, _serving_queue, _spliced, _stats, _timer_action, _tunnel_moved
    cdef public object _unreported, _upstream_action, _upstream_timeout, _waiting, bulk_written
    cdef public object cfg, proxy, raw_transport, transport, valve

    cpdef data_received(self, data)
    @cython.locals(ex=Exchange, upstream=UpstreamCore, stats=HotStats, pool=PoolCore)
    cpdef _serve_whole(self, data)
    cpdef _send(self, data)
    cpdef _write_batch(self)
    @cython.locals(ex=Exchange, stats=HotStats, pool=PoolCore)
    cpdef response_whole(self, status, length, data)


cdef class UpstreamCore:
    cdef public object _body_left, _bulk, _close_delimited, _complete, _final, _first_read
    cdef public object _got_bytes, _headers, _in_head, _method, _parser, _past_parser, _reason
    cdef public object _spliced, _stats, _status, backpressure, bulk_written, connected, handler
    cdef public object idle_since, key, pool, request_sent, reusable, reused, transport
    cdef public object unreachable, valve, write_paused

    cpdef begin(self, handler, method)
    @cython.locals(client=ClientCore, stats=HotStats)
    cpdef data_received(self, data)


cdef class PoolCore:
    cdef public object _idle, _max_idle, _seconds, _stats, _sweep

    @cython.locals(conn=UpstreamCore, idle=list, stats=HotStats)
    cpdef take_idle(self, target)
    @cython.locals(idle=list, stats=HotStats)
    cpdef release(self, UpstreamCore conn)
