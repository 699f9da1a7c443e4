// ipywidgets 8's widget manager typesets labels with MathJax 2's `MathJax.Hub.Queue`; the site runs MathJax 3, which
// has no `Hub` and replaces `window.MathJax` as it starts. So every object `window.MathJax` holds gets a small `Hub`
// that hands the element to MathJax 3 (its first typeset of the page covers labels drawn before it is ready).
(function () {
  const hub = {Queue: (job) => window.MathJax.typesetPromise && window.MathJax.typesetPromise([job[2]])};
  let current = window.MathJax;
  const withHub = (value) => { if (value && typeof value === 'object' && !value.Hub) value.Hub = hub; return value; };
  Object.defineProperty(window, 'MathJax', {configurable: true, get: () => current,
                                            set: (value) => { current = withHub(value); }});
  withHub(current);
})();
