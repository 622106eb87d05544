/* FNV-1a-64, the CENTRAL sharding hash of docs/design.md, in C.
 *
 * Why native code: in Python every key byte costs a big-int XOR, multiply and mask (~2 us for a
 * 25-byte e-mail), which kept routing a CENTRAL key the router has not seen at ~0.3 M/s. Here it
 * is ~40 ns. mdb/fnv.py holds the Python reference and falls back to it when this module was not
 * built (no compiler at install time); tests/unit/test_fnv.py checks both give the same hash for any
 * bytes. Keep the two in step: the hash decides where data lives.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define FNV_OFFSET_BASIS 14695981039346656037ULL
#define FNV_PRIME 1099511628211ULL

static inline uint64_t
hash_buffer(const unsigned char *p, Py_ssize_t n)
{
    uint64_t h = FNV_OFFSET_BASIS;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= FNV_PRIME; /* unsigned arithmetic wraps mod 2^64, as the spec's "& mask" */
    }
    return h;
}

/* Any bytes-like object (bytes, bytearray, memoryview, array): its raw bytes in C order, as
 * memoryview(data).tobytes() gives them, the contract of the Python reference. A str or an int
 * is refused with the buffer protocol's TypeError. */
static int
hash_object(PyObject *data, uint64_t *out)
{
    if (PyBytes_CheckExact(data)) {
        *out = hash_buffer((const unsigned char *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) == 0) {
        *out = hash_buffer((const unsigned char *)view.buf, view.len);
        PyBuffer_Release(&view);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_BufferError)) {
        return -1;
    }
    PyErr_Clear(); /* a buffer, but not contiguous (a strided memoryview): hash a contiguous copy */
    PyObject *copy = PyBytes_FromObject(data);
    if (copy == NULL) {
        return -1;
    }
    *out = hash_buffer((const unsigned char *)PyBytes_AS_STRING(copy), PyBytes_GET_SIZE(copy));
    Py_DECREF(copy);
    return 0;
}

static PyObject *
fnv1a_64(PyObject *Py_UNUSED(module), PyObject *data)
{
    uint64_t h;
    if (hash_object(data, &h) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *
fnv1a_64_many(PyObject *Py_UNUSED(module), PyObject *datas)
{
    PyObject *seq = PySequence_Fast(datas, "fnv1a_64_many() takes a sequence of bytes-like objects");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        PyObject *value;
        if (hash_object(PySequence_Fast_GET_ITEM(seq, i), &h) < 0
            || (value = PyLong_FromUnsignedLongLong(h)) == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        PyList_SET_ITEM(out, i, value);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef fnv_methods[] = {
    {"fnv1a_64", fnv1a_64, METH_O, "FNV-1a, 64-bit, of a bytes-like object."},
    {"fnv1a_64_many", fnv1a_64_many, METH_O, "[fnv1a_64(d) for d in datas]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fnv_module = {
    PyModuleDef_HEAD_INIT,
    "mdb._fnv",
    "FNV-1a-64 in C (see mdb/fnv.py for the Python reference and the fallback).",
    0,
    fnv_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__fnv(void)
{
    return PyModule_Create(&fnv_module);
}
